"""edl.cli.allocator: the console script's huge-pages environment, and the script itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edl.cli.allocator import HUGE_PAGES, _glibc_version, huge_pages_environment

GLIBC = (2, 36)


def test_huge_pages_are_added_once_and_never_override_the_caller():
    assert huge_pages_environment({"A": "1"}, GLIBC) == {"A": "1", "GLIBC_TUNABLES": HUGE_PAGES}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    assert huge_pages_environment(other, GLIBC)["GLIBC_TUNABLES"] == (
        f"glibc.malloc.arena_max=1:{HUGE_PAGES}"
    )
    # Already decided (by the caller, or by the re-executed process itself): go on as is.
    for tunables in (HUGE_PAGES, "glibc.malloc.hugetlb=0", f"x=1:{HUGE_PAGES}"):
        assert huge_pages_environment({"GLIBC_TUNABLES": tunables}, GLIBC) is None
    assert huge_pages_environment({"EDL_HUGE_PAGES": "0"}, GLIBC) is None
    assert huge_pages_environment({}, (2, 34)) is None  # no such tunable before 2.35
    assert huge_pages_environment({}, None) is None  # not glibc


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables are Linux's")
def test_console_script_reexecutes_with_huge_pages_once(tmp_path):
    """The installed ``edl`` script runs under the tunable (read back from /proc by a
    stand-in script that shares its code path) and answers as ``main`` does."""
    script = Path(sys.executable).with_name("edl")
    if not script.is_file():
        pytest.skip(f"no console script beside {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "EDL_HUGE_PAGES")}
    done = subprocess.run(
        [str(script), "train", "--steps", "0"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "steps must be >= 1, got 0" in done.stderr
    probe = tmp_path / "probe.py"  # what the console script does, then report the tunables
    probe.write_text(
        "import os\nfrom edl.cli.allocator import reexec_with_huge_pages\n"
        "reexec_with_huge_pages()\n"
        "print(open('/proc/self/environ', 'rb').read().split(b'\\0').count("
        "b'GLIBC_TUNABLES=" + HUGE_PAGES + "'), os.getpid())\n"
    )
    if huge_pages_environment(env, _glibc_version()) is None:
        pytest.skip("this C library has no huge-pages tunable: nothing to set")
    for setting, count in (("1", "1"), ("0", "0")):
        out = subprocess.run(
            [sys.executable, str(probe)],
            env={**env, "EDL_HUGE_PAGES": setting},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert out.stdout.split()[0] == count, (setting, out.stdout)
