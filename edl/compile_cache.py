"""jax's persistent compilation cache, as the ``edl`` command turns it on.

XLA compiles every jitted program a process runs (a train step, each of ``edl serve``'s step
shapes, the decode loop of ``edl generate``), and a new process compiles them all again. jax
can keep compiled programs on disk, keyed by the program, the jaxlib version, the backend and
its version, the XLA flags and the compile options, so a restart with the same shapes loads
them instead (XLA:CPU included: ``tests/test_compile_cache.py`` counts the hits of a second
process).

The ``edl`` command (``edl train``, ``edl serve``, ``edl generate``, ...) calls
``enable_compile_cache()`` before any work; ``import edl`` as a library changes nothing, and
a program turns the cache on for itself with::

    import edl
    edl.enable_compile_cache()  # ~/.cache/edl/jax/jax-<jax>-jaxlib-<jaxlib>, or as below

Where (``cache_directory``): jax's own ``JAX_COMPILATION_CACHE_DIR`` when set, else
``$XDG_CACHE_HOME/edl/jax`` (``~/.cache/edl/jax`` without it), in a subdirectory per jax and
jaxlib version. jax's keys already hold the jaxlib and backend versions, so old entries are
never loaded by a new jax; the subdirectory only keeps each version's files together, so an
old version's are removed as one directory. ``EDL_COMPILE_CACHE=0`` leaves the cache off
(jax's own settings, such as a ``JAX_COMPILATION_CACHE_DIR`` of the caller, still apply).

Which programs: every one that took at least ``MIN_COMPILE_SECONDS`` to compile (jax's
default, 1 s, skips most of a small model's CPU programs, which still cost seconds
together), of any size. A ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` /
``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES`` in the environment wins over these; so does
``JAX_COMPILATION_CACHE_MAX_SIZE`` (bytes; jax's default: no limit, so the directory grows
until removed).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "MIN_COMPILE_SECONDS",
    "announce_compile",
    "cache_directory",
    "cache_hits",
    "enable_compile_cache",
]

MIN_COMPILE_SECONDS = 0.05
"""Programs compiling faster than this are not written: reading a cache file costs about a
millisecond, and the many trivial programs of eager code (a cast, a broadcast) would fill
the directory with files worth nothing."""

OFF = "EDL_COMPILE_CACHE"
"""The environment variable that turns the command's cache off (``0``)."""

_JAX_DIR = "JAX_COMPILATION_CACHE_DIR"
_HIT = "/jax/compilation_cache/cache_hits"
_hits = [0]  # persistent-cache hits in this process, counted once enable_compile_cache ran
_counting = [False]


def _count(event: str, **_: object) -> None:
    if event == _HIT:
        _hits[0] += 1


def cache_hits() -> int:
    """Programs this process loaded from the persistent cache since ``enable_compile_cache``
    (jax's ``/jax/compilation_cache/cache_hits`` events; 0 before it)."""
    return _hits[0]


def cache_directory(
    environ: Mapping[str, str], versions: tuple[str, str], home: Path | None = None
) -> Path | None:
    """Where the ``edl`` command keeps compiled programs, or None when it keeps none.

    Args:
        environ: the environment (``os.environ``).
        versions: ``(jax, jaxlib)`` version strings, the subdirectory's name.
        home: the user's home directory (default: ``Path.home()``, read only when needed).

    None when ``environ`` has ``EDL_COMPILE_CACHE=0``; ``JAX_COMPILATION_CACHE_DIR`` as
    given (jax's own setting, no subdirectory added); else ``$XDG_CACHE_HOME/edl/jax/
    jax-<jax>-jaxlib-<jaxlib>`` (an ``XDG_CACHE_HOME`` that is empty or relative is
    ignored, as the XDG spec says: ``~/.cache`` instead).
    """
    switch = environ.get(OFF, "1").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None
    if switch not in ("", "1", "true", "yes", "on"):
        raise ValueError(f"{OFF} must be 0 (off) or 1 (on), got {environ[OFF]!r}")
    if environ.get(_JAX_DIR):
        return Path(environ[_JAX_DIR]).expanduser()
    xdg = environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if xdg and Path(xdg).is_absolute() else (home or Path.home()) / ".cache"
    jax_version, jaxlib_version = versions
    return root / "edl" / "jax" / f"jax-{jax_version}-jaxlib-{jaxlib_version}"


def enable_compile_cache(directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Turn jax's persistent compilation cache on for this process; returns its directory,
    or None where ``EDL_COMPILE_CACHE=0`` says no (and ``directory`` is None).

    ``directory`` (default: ``cache_directory(os.environ, ...)``) is created if missing. The
    thresholds are set (``MIN_COMPILE_SECONDS``, any size) unless the environment sets
    jax's own. Call it before the programs to cache are compiled; programs already compiled
    in this process stay in memory as they are.
    """
    import jax
    import jaxlib

    if directory is None:
        directory = cache_directory(os.environ, (jax.__version__, jaxlib.__version__))
        if directory is None:
            return None
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"enable_compile_cache: cannot create the compilation cache directory {path}: "
            f"{e} (set JAX_COMPILATION_CACHE_DIR elsewhere, or {OFF}=0 to keep none)"
        ) from e
    jax.config.update("jax_compilation_cache_dir", str(path))
    if not _counting[0]:
        jax.monitoring.register_event_listener(_count)
        _counting[0] = True
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        # -1: any size, and no override by jax's file-system-specific minimum.
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


@contextlib.contextmanager
def announce_compile(what: str, echo: Callable[[str], None]) -> Iterator[None]:
    """Say on ``echo`` that ``what`` compiles (``"compiling the train step ..."``), run the
    body, then how long it took and whether the persistent cache served it::

        with announce_compile("the train step", print):
            compiled = step.lower(state, batch).compile()

    prints ``compiling the train step ...`` then ``the train step ready in 12.3 s
    (compiled)`` or ``... (from the compilation cache)``. Nothing is printed after a body
    that raised (its error says what happened)."""
    echo(f"compiling {what} ...")
    start, hits = time.perf_counter(), cache_hits()
    yield
    source = "from the compilation cache" if cache_hits() > hits else "compiled"
    echo(f"{what} ready in {time.perf_counter() - start:.1f} s ({source})")
