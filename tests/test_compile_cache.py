"""jax's persistent compilation cache as the ``edl`` command uses it (``edl.compile_cache``):
where it lives, how it is turned off, that a second process loads what the first compiled,
and that the programs a user waits on (the train step, the serving steps) can be cached.

The suite runs with ``EDL_COMPILE_CACHE=0`` (``conftest.py``); the tests that turn the cache
on do it in subprocesses, with the cache in a temporary directory, so the test process's
jax settings and the user's real cache are never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edl.compile_cache import MIN_COMPILE_SECONDS, announce_compile, cache_directory

VERSIONS = ("0.10.2", "0.10.1")
SUBDIR = Path("edl", "jax", "jax-0.10.2-jaxlib-0.10.1")


def test_the_directory_is_under_xdg_cache_home_per_version(tmp_path):
    home = tmp_path / "home"
    assert cache_directory({}, VERSIONS, home) == home / ".cache" / SUBDIR
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cache_directory(xdg, VERSIONS, home) == tmp_path / "xdg" / SUBDIR
    # The XDG spec: an empty or relative XDG_CACHE_HOME is ignored.
    for ignored in ("", "relative/cache"):
        assert cache_directory({"XDG_CACHE_HOME": ignored}, VERSIONS, home) == (
            home / ".cache" / SUBDIR
        )
    # Another jax or jaxlib: another directory (old entries are never read, and go as one).
    assert cache_directory({}, ("0.10.3", "0.10.1"), home) != cache_directory({}, VERSIONS, home)


def test_jax_compilation_cache_dir_wins_and_edl_compile_cache_0_turns_it_off(tmp_path):
    mine = str(tmp_path / "mine")
    both = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_COMPILATION_CACHE_DIR": mine}
    assert cache_directory(both, VERSIONS, tmp_path) == Path(mine)  # as given, no subdirectory
    for off in ("0", "false", "off", "No"):
        assert cache_directory({**both, "EDL_COMPILE_CACHE": off}, VERSIONS, tmp_path) is None
    for on in ("1", "true", "on", ""):
        assert cache_directory({**both, "EDL_COMPILE_CACHE": on}, VERSIONS, tmp_path) == Path(mine)
    with pytest.raises(
        ValueError, match=r"EDL_COMPILE_CACHE must be 0 \(off\) or 1 \(on\), got 'maybe'"
    ):
        cache_directory({"EDL_COMPILE_CACHE": "maybe"}, VERSIONS, tmp_path)


def test_the_suite_never_writes_to_the_users_cache():
    assert os.environ["EDL_COMPILE_CACHE"] == "0"
    assert cache_directory(os.environ, VERSIONS) is None


def test_announce_compile_says_what_compiles_and_how_long_it_took():
    lines: list[str] = []
    with announce_compile("the train step", lines.append):
        assert lines == ["compiling the train step ..."]  # before the work, not after
    assert len(lines) == 2
    assert lines[1].startswith("the train step ready in ") and lines[1].endswith(" s (compiled)")
    with pytest.raises(RuntimeError), announce_compile("a failing step", lines.append):
        raise RuntimeError("boom")
    assert lines[-1] == "compiling a failing step ..."  # no "ready" after a failure


# A small program, announced as the CLI does; the process prints its cache hits last. The
# environment's JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 (which enable_compile_cache
# leaves alone) has it written however fast this machine compiles it.
_PROGRAM = """
import sys
import jax, jax.numpy as jnp
from edl.compile_cache import announce_compile, cache_hits, enable_compile_cache

where = enable_compile_cache()
print("cache:", where, file=sys.stderr)

@jax.jit
def chain(x):
    for i in range(8):
        x = jnp.tanh(x @ x.T + i)
    return x

with announce_compile("the chain", lambda m: print(m, file=sys.stderr)):
    chain.lower(jnp.ones((8, 8))).compile()
print(cache_hits())
"""


def _run(env: dict[str, str], times: int) -> list[subprocess.CompletedProcess]:
    env = {**env, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(times):
        runs.append(
            subprocess.run(
                [sys.executable, "-c", _PROGRAM],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        )
        assert runs[-1].returncode == 0, runs[-1].stderr
    return runs


def test_a_second_process_loads_the_first_ones_programs(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "EDL_COMPILE_CACHE": "1"}
    first, second = _run(env, 2)
    written = list((tmp_path / "edl" / "jax").glob("jax-*-jaxlib-*/jit_chain-*-cache"))
    assert len(written) == 1, sorted(p.name for p in tmp_path.rglob("*"))
    assert int(first.stdout.split()[-1]) == 0 and "(compiled)" in first.stderr
    assert int(second.stdout.split()[-1]) >= 1
    assert "the chain ready in" in second.stderr
    assert "(from the compilation cache)" in second.stderr


def test_edl_compile_cache_0_writes_nothing(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "EDL_COMPILE_CACHE": "0"}
    (run,) = _run(env, 1)
    assert "cache: None" in run.stderr
    assert int(run.stdout.split()[-1]) == 0 and "(compiled)" in run.stderr
    assert not (tmp_path / "edl" / "jax").exists()
    assert MIN_COMPILE_SECONDS < 1.0  # jax's default (1 s) would skip most CPU programs


def test_the_cli_train_path_checks_ids_on_the_host():
    """``edl train``'s steps hold no in-program id check (a host callback jax never caches):
    the batches are checked on the host instead, with the same message."""
    from edl.cli.run import HostCheckedBatches

    good = {"input_ids": np.array([[1, 2, 63]]), "labels": np.array([[2, -100, 5]])}
    data = HostCheckedBatches(iter([good, {**good, "input_ids": np.array([[1, 64, 2]])}]), 64)
    assert next(data) is good
    with pytest.raises(
        ValueError, match=r"input_ids must lie in \[0, 64\) \(vocab_size 64\), got 64"
    ):
        next(data)
    bad_labels = HostCheckedBatches(iter([{**good, "labels": np.array([[-1, 2, 3]])}]), 64)
    with pytest.raises(ValueError, match=r"labels must be -100 \(ignored\) or lie in \[0, 64\)"):
        next(bad_labels)
    assert not hasattr(data, "position")  # a plain iterator is no Resumable one


@pytest.mark.slow  # two tiny edl train runs in subprocesses (~35 s)
def test_a_restarted_edl_train_loads_its_train_eval_and_sample_programs(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "EDL_COMPILE_CACHE": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [
        *("train", "--steps", "2", "--hidden-size", "32", "--intermediate-size", "64"),
        *("--num-layers", "1", "--corpus-bytes", "100000", "--seq-len", "32"),
        *("--batch-size", "2", "--sample-tokens", "4", "--eval-every", "2"),
        *("--eval-batches", "1", "--trackers", "none", "--overwrite"),
        *("--output-dir", str(tmp_path / "run")),
    ]
    code = f"from edl.cli import main; main({argv!r})"
    runs = []
    for _ in range(2):
        runs.append(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
            )
        )
        assert runs[-1].returncode == 0, runs[-1].stderr
    first, second = (r.stderr.replace("\r", "\n").splitlines() for r in runs)
    for what in ("the train step", "the eval step", "the sample's decode loop"):
        ready = [[x for x in lines if what in x and " ready in " in x] for lines in (first, second)]
        assert [len(r) for r in ready] == [1, 1], (what, runs[1].stderr)
        assert ready[0][0].endswith("(compiled)")
        assert ready[1][0].endswith("(from the compilation cache)")
        assert any(f"compiling {what}" in x for x in second)


def test_the_commands_that_compile_read_edl_compile_cache(tmp_path, monkeypatch, capsys):
    """``edl train`` / ``generate`` / ``serve`` / ``export`` turn the cache on before any
    work: a bad ``EDL_COMPILE_CACHE`` is one line and exit status 2 (``info`` compiles
    nothing and does not read it)."""
    from edl.cli import main

    monkeypatch.setenv("EDL_COMPILE_CACHE", "maybe")
    with pytest.raises(SystemExit) as caught:
        main(["export", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == "edl export: error: EDL_COMPILE_CACHE must be 0 (off) or 1 (on), got 'maybe'\n"
    with pytest.raises(SystemExit) as caught:
        main(["info", str(tmp_path / "missing")])
    assert "EDL_COMPILE_CACHE" not in capsys.readouterr().err
