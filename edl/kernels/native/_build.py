"""Compiling edl's native CPU kernels and registering them with XLA (see the package
docstring for where the library is cached and how to turn the kernels off)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import jax

from edl.kernels.native import _cache

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "paged_attention.cc", _HERE / "flash_attention.cc")
_HEADERS = (_HERE / "common.h",)
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# XLA custom-call target name -> the library's handler symbol.
TARGETS = {
    "edl_paged_attention": "EdlPagedAttention",
    "edl_paged_attention_quantized": "EdlPagedAttentionQuantized",
    "edl_flash_attention_forward": "EdlFlashAttentionForward",
    "edl_flash_attention_backward": "EdlFlashAttentionBackward",
}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags: libraries built with ``-march=native``
    for one CPU may not run on another with the same model name (a VM's masked flags)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features")  # x86; aarch64 names its flags Features
    found = {line.split(":", 1)[0].strip(): line for line in lines if line.startswith(wanted)}
    return "\n".join(found.values()) or platform.processor()


def _cache_dir() -> Path:
    if "EDL_KERNEL_CACHE" in os.environ:
        return Path(os.environ["EDL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edl" / "kernels"


@dataclasses.dataclass(frozen=True)
class Build:
    """One shared library to compile: ``compiler`` run with ``flags`` and ``-I`` each of
    ``includes`` on ``sources`` (``headers``: the files they include), exporting ``symbols``.
    Cached as ``<name>-<key>.so``, the key a hash of :meth:`inputs`."""

    compiler: str
    flags: tuple[str, ...]
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    includes: tuple[str, ...] = ()
    symbols: tuple[str, ...] = ()
    name: str = "edl_native"

    def inputs(self) -> dict[str, Any]:
        """What the library is built from (its key hashes this; its record repeats it): the
        sources' and headers' SHA-256, the flags, compiler, symbols, jaxlib and CPU."""
        files = (*self.sources, *self.headers)
        return {
            "sources": [[p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in files],
            "flags": list(self.flags),
            "compiler": self.compiler,
            "symbols": list(self.symbols),
            "jaxlib": importlib.metadata.version("jaxlib"),
            "machine": platform.machine(),
            "cpu": _cpu_model(),
        }

    def command(self, output: Path) -> list[str]:
        """The compiler's command line writing the library to ``output``."""
        includes = (f"-I{directory}" for directory in self.includes)
        return [self.compiler, *self.flags, *includes, *map(str, self.sources), "-o", str(output)]


def kernels_build() -> Build:
    """edl's kernels for this machine: the first compiler of ``$CXX``, ``c++``, ``g++``,
    ``clang++``, edl's flags then ``$EDL_NATIVE_CXXFLAGS``, against jaxlib's FFI headers.
    Raises ``RuntimeError`` when no compiler is found."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    flags = (*_FLAGS, *os.environ.get("EDL_NATIVE_CXXFLAGS", "").split())
    include = (jax.ffi.include_dir(),)
    return Build(compiler, flags, _SOURCES, _HEADERS, include, tuple(TARGETS.values()))


def _compile(build: Build, library: Path) -> None:
    """Compile ``build`` to a temporary file beside ``library``, then move it there whole."""
    _cache.clean_orphans(library.parent)
    tmp = _cache.temporary(library.parent, ".so")
    command = build.command(tmp)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"building edl's native kernels failed ({' '.join(command)}):\n"
                f"{done.stderr[-4000:]}"
            )
        _cache.commit(tmp, library, 0o700)
    finally:
        tmp.unlink(missing_ok=True)


def build_library(cache_dir: Path | None = None, build: Build | None = None) -> Path:
    """The path of ``build``'s library (default: edl's kernels, :func:`kernels_build`) in
    ``cache_dir`` (default: the package docstring's), compiled unless a verified one is there.

    The cache directory is created private (0700, with any parents edl creates). A library is
    verified before it is returned: its SHA-256 and build key equal those in its JSON record
    (``<library>.json``); one that fails is rebuilt, with a warning naming it. The compiler
    writes to a temporary file that is flushed to disk and renamed (the directory flushed
    too), and the record is written the same way after it, so a killed build or a full disk
    never leaves a truncated library under the name and concurrent builds both end with a
    whole one; temporaries of killed builds are removed (see ``_cache.clean_orphans``).

    Raises ``UnsafeCacheError`` (a ``RuntimeError``) naming the cache directory, library or
    record if another user owns it or its group or others can write it (they could plant
    code); ``RuntimeError`` naming the compiler command and its output if the build fails
    (and the library that failed verification, if one did)."""
    build = kernels_build() if build is None else build
    cache_dir = _cache.private_dir(_cache_dir() if cache_dir is None else cache_dir)
    inputs = build.inputs()
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    library = cache_dir / f"{build.name}-{key[:20]}.so"
    record = library.with_suffix(".json")
    why = None
    if library.exists():
        why = _cache.problem(library, record, key)
        if why is None:
            return library
        warnings.warn(f"rebuilding the native kernel library {library}: {why}", stacklevel=2)
    try:
        _compile(build, library)
    except RuntimeError as error:
        if why is None:
            raise
        raise RuntimeError(
            f"the kernel library {library} failed verification ({why}) and rebuilding it "
            f"failed: {error}"
        ) from error
    # Hash what is there now: a concurrent build may have replaced ours, and its record
    # then agrees with it.
    digest = _cache.sha256(library)
    _cache.write_record(
        record, {"library": library.name, "sha256": digest, "key": key, "inputs": inputs}
    )
    return library


def load_library(cache_dir: Path | None = None, build: Build | None = None) -> ctypes.CDLL:
    """:func:`build_library`'s library, loaded with ctypes after its verification (``dlopen``
    runs its initialisers; nothing of it is called here) and checked to export
    ``build.symbols``. A library lacking one raises ``RuntimeError`` naming it and the
    symbols, and loses its record, so that the next process rebuilds it."""
    build = kernels_build() if build is None else build
    path = build_library(cache_dir, build)
    library = ctypes.CDLL(str(path))
    missing = [symbol for symbol in build.symbols if not hasattr(library, symbol)]
    if missing:
        path.with_suffix(".json").unlink(missing_ok=True)
        raise RuntimeError(
            f"the kernel library {path} lacks the symbols {', '.join(missing)}: not the "
            "library edl built; its record is removed so that the next process rebuilds it"
        )
    return library


def turned_off() -> bool:
    """Whether the environment turns the native kernels off (``EDL_NATIVE_KERNELS=0``)."""
    return os.environ.get("EDL_NATIVE_KERNELS", "1") == "0"


@functools.cache
def _registered() -> str | None:
    """Build (or find) the library and register its handlers with XLA once per process;
    None when ready, else why not."""
    if turned_off():
        return "turned off by EDL_NATIVE_KERNELS=0"
    try:
        library = load_library()
    except (RuntimeError, OSError) as error:
        return f"the native CPU kernels are unavailable: {error}"
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return None


def unavailable() -> str | None:
    """None when the native kernels can run in this process (building them on first call),
    else the reason they cannot: turned off, no compiler, a failed build, a library that
    fails verification and cannot be rebuilt or lacks the kernels' symbols, a cache
    directory or file another user could write (each named). Callers then fall back to XLA
    or Pallas with a warning rather than raising."""
    return _registered()
