"""edl.kernels.native's library cache: a truncated, foreign or altered library is never
loaded (rebuilt, or the kernels fall back with a warning naming it), a cache another user
could write is refused, temporaries of killed builds are removed, concurrent builds both end
with a whole library.

Most cases compile a one-function library (``_tiny``, a fraction of a second) through
``build_library``'s ``build`` argument; those about edl's own library copy the one the
default cache already holds, under a compiler that fails, so nothing compiles the kernels.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edl.kernels import native
from edl.kernels.native import _build, _cache

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(_build._compiler() is None, reason="no C++ compiler")

needs_kernels = pytest.mark.skipif(
    _build._compiler() is None or native.unavailable() is not None,
    reason=f"native kernels: {native.unavailable()}",
)


def _tiny(tmp_path: Path, symbols=("EdlCacheTest",), body="int EdlCacheTest() { return 7; }"):
    """A ``Build`` of a one-function C++ library exporting ``symbols``."""
    source = tmp_path / f"tiny-{abs(hash(body))}.cc"
    source.write_text(f'extern "C" {{ {body} }}\n')
    flags = ("-O0", "-shared", "-fPIC")
    return _build.Build(_build._compiler(), flags, (source,), symbols=tuple(symbols), name="tiny")


def _failing_compiler(tmp_path: Path, monkeypatch) -> None:
    """Put a compiler that always fails first on PATH under the name edl resolves, so edl's
    key (and its library's name) stays the same but no rebuild can succeed."""
    name = _build._compiler()
    if os.sep in name:
        pytest.skip(f"$CXX is a path ({name}): cannot shadow it on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / name
    fake.write_text("#!/bin/sh\necho 'planted compiler failure' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _seeded_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A private cache directory holding a copy of edl's library (and its record, where the
    code records one), named as edl expects; returns the cache and the library's path."""
    built = native.build_library()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for path in (built, built.with_suffix(".json")):
        if path.exists():
            shutil.copy2(path, cache / path.name)
    return cache, cache / built.name


@needs_kernels
def test_truncated_library_is_never_loaded_and_the_process_survives(tmp_path, monkeypatch):
    """``dlopen`` of a truncated library kills the process with SIGBUS: the hash is checked
    first, and with no compiler to rebuild it the kernels fall back, naming the file."""
    cache, library = _seeded_cache(tmp_path)
    os.truncate(library, library.stat().st_size // 2)  # a killed build, a full disk
    _failing_compiler(tmp_path, monkeypatch)
    env = {**os.environ, "EDL_KERNEL_CACHE": str(cache)}
    script = "from edl.kernels import native; print(native.unavailable())"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert str(library) in done.stdout and "differs from the" in done.stdout, done.stdout
    assert "rebuilding it failed" in done.stdout and "planted compiler failure" in done.stdout


@needs_kernels
def test_foreign_library_under_the_name_falls_back_instead_of_attribute_error(
    tmp_path, monkeypatch
):
    """A library of someone else's under the expected name (no record): rebuilt, and where
    that fails, the kernels fall back with the file named (was ``AttributeError: undefined
    symbol`` at the first forward). With a record forged for it, the symbol check refuses it
    and drops the record."""
    real_record = native.build_library().with_suffix(".json")  # before the cache moves
    cache, library = _seeded_cache(tmp_path)
    foreign = _build.build_library(tmp_path / "foreign", _tiny(tmp_path, symbols=()))
    shutil.copy(foreign, library)
    library.with_suffix(".json").unlink(missing_ok=True)
    _failing_compiler(tmp_path, monkeypatch)
    monkeypatch.setenv("EDL_KERNEL_CACHE", str(cache))
    with pytest.warns(UserWarning, match="rebuilding the native kernel library .*no record"):
        reason = _build._registered.__wrapped__()
    assert reason is not None and str(library) in reason and "rebuilding it failed" in reason

    record = json.loads(real_record.read_text())
    record["sha256"] = _cache.sha256(library)  # a record that vouches for the foreign bytes
    library.with_suffix(".json").write_text(json.dumps(record))
    library.with_suffix(".json").chmod(0o600)
    reason = _build._registered.__wrapped__()
    assert reason is not None and str(library) in reason
    assert "lacks the symbols EdlPagedAttention" in reason
    assert not library.with_suffix(".json").exists()  # the next process rebuilds it


@pytest.mark.parametrize(
    "damage",
    ["truncate", "other_bytes", "wrong_hash", "other_key", "not_json", "no_record"],
)
def test_a_library_that_fails_verification_is_rebuilt(tmp_path, damage):
    build = _tiny(tmp_path)
    library = _build.build_library(tmp_path / "cache", build)
    record = library.with_suffix(".json")
    data = json.loads(record.read_text())
    if damage == "truncate":
        os.truncate(library, 100)
    elif damage == "other_bytes":
        other = _tiny(tmp_path, (), body="int Other() { return 1; }")
        shutil.copy(_build.build_library(tmp_path / "other", other), library)
    elif damage == "not_json":
        record.write_text("{")
    elif damage == "no_record":
        record.unlink()
    else:
        field = {"wrong_hash": "sha256", "other_key": "key"}[damage]
        record.write_text(json.dumps({**data, field: "0" * 64}))
    with pytest.warns(
        UserWarning, match=re.escape(f"rebuilding the native kernel library {library}")
    ):
        assert _build.build_library(tmp_path / "cache", build) == library
    assert _cache.problem(library, record, data["key"]) is None
    assert _build.load_library(tmp_path / "cache", build).EdlCacheTest() == 7


def test_a_cache_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(native.UnsafeCacheError, match=re.escape(f"{cache}: writable by its")):
        _build.build_library(cache, _tiny(tmp_path))
    assert not any(cache.iterdir())
    # Through registration: the documented fallback, with a reason naming the directory.
    monkeypatch.setenv("EDL_KERNEL_CACHE", str(cache))
    reason = _build._registered.__wrapped__()
    assert reason is not None and f"refusing the kernel cache directory {cache}" in reason


def test_a_cache_or_library_of_another_user_or_writable_by_others_is_refused(tmp_path, monkeypatch):
    build = _tiny(tmp_path)
    library = _build.build_library(tmp_path / "cache", build)
    library.chmod(0o777)
    with pytest.raises(native.UnsafeCacheError, match=re.escape(f"library {library}: writable")):
        _build.build_library(tmp_path / "cache", build)
    library.chmod(0o700)
    library.with_suffix(".json").chmod(0o620)
    with pytest.raises(
        native.UnsafeCacheError, match=re.escape(f"record {library.with_suffix('.json')}: writable")
    ):
        _build.build_library(tmp_path / "cache", build)
    library.with_suffix(".json").chmod(0o600)
    assert _build.build_library(tmp_path / "cache", build) == library
    monkeypatch.setattr(_cache, "_user", lambda: os.getuid() + 1)
    mine = re.escape(f"directory {tmp_path / 'cache'}: owned by uid {os.getuid()}, not by")
    with pytest.raises(native.UnsafeCacheError, match=mine):
        _build.build_library(tmp_path / "cache", build)


def test_build_writes_a_private_cache_with_a_verified_record(tmp_path):
    cache = tmp_path / "new" / "kernels"
    library = _build.build_library(cache, _tiny(tmp_path))
    for directory in (cache, cache.parent):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    record = json.loads(library.with_suffix(".json").read_text())
    assert record["sha256"] == _cache.sha256(library) and record["library"] == library.name
    assert record["inputs"]["symbols"] == ["EdlCacheTest"]
    assert sorted(p.name for p in cache.iterdir()) == [f"{library.stem}.json", library.name]
    for path in (library, library.with_suffix(".json")):
        assert path.stat().st_mode & 0o077 == 0, path  # private


def test_temporaries_of_killed_builds_are_removed_and_live_ones_kept(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    pid_script = "import os; print(os.getpid())"
    gone = subprocess.run([sys.executable, "-c", pid_script], capture_output=True, text=True)
    host, dead_pid = _cache._host(), int(gone.stdout)
    names = {
        "killed": f".build-{host}-{dead_pid}-abc.so",  # this host, its process gone
        "stale": f".build-{host}-{os.getpid()}-old.so",  # a live pid, but hours old
        "old_format": ".build-x1y2z3.so",  # another version's name: age alone decides
        "live": f".build-{host}-{os.getpid()}-new.so",  # a build in progress: kept
        "other_host": f".build-elsewhere-{dead_pid}-abc.json",  # cannot tell: young, kept
    }
    for label, name in names.items():
        (cache / name).write_bytes(b"partial")
        if label in ("stale", "old_format"):
            hours_ago = time.time() - 3 * 3600
            os.utime(cache / name, (hours_ago, hours_ago))
    _build.build_library(cache, _tiny(tmp_path))
    left = {p.name for p in cache.iterdir()}
    assert {label for label, name in names.items() if name in left} == {"live", "other_host"}


_CONCURRENT = """
import sys
from pathlib import Path
from edl.kernels.native import _build
build = _build.Build(_build._compiler(), ("-O0", "-shared", "-fPIC"), (Path(sys.argv[2]),),
                     symbols=("EdlCacheTest",), name="tiny")
print(_build.load_library(Path(sys.argv[1]), build).EdlCacheTest())
"""


def test_two_processes_building_at_once_both_end_with_a_whole_library(tmp_path):
    build = _tiny(tmp_path)
    cache = tmp_path / "cache"
    command = [sys.executable, "-c", _CONCURRENT, str(cache), str(build.sources[0])]
    runs = [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0 and out.decode().strip() == "7", err.decode()[-3000:]
    (library,) = cache.glob("tiny-*.so")
    key = json.loads(library.with_suffix(".json").read_text())["key"]
    assert _cache.problem(library, library.with_suffix(".json"), key) is None
    assert not list(cache.glob(".build-*"))
