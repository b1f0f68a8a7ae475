"""Compiling edl's native CPU kernels and registering them with XLA (see the package
docstring for where the library is cached and how to turn the kernels off)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "paged_attention.cc", _HERE / "flash_attention.cc")
_HEADERS = (_HERE / "common.h",)
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# XLA custom-call target name -> the library's handler symbol.
TARGETS = {
    "edl_paged_attention": "EdlPagedAttention",
    "edl_flash_attention_forward": "EdlFlashAttentionForward",
    "edl_flash_attention_backward": "EdlFlashAttentionBackward",
}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    if "EDL_KERNEL_CACHE" in os.environ:
        return Path(os.environ["EDL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edl" / "kernels"


def build_library(cache_dir: Path | None = None) -> Path:
    """Compile the kernels' sources into one library in ``cache_dir`` (default: the package
    docstring's), unless a library built from the same sources, flags (edl's, then
    ``$EDL_NATIVE_CXXFLAGS``), jaxlib and CPU is there already. Returns its path; raises
    ``RuntimeError`` naming the compiler command and its output if the build fails. The
    library is written to a temporary file and renamed, so concurrent processes never load a
    half-written one."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    parts = [path.read_bytes() for path in (*_SOURCES, *_HEADERS)]
    flags = (*_FLAGS, *os.environ.get("EDL_NATIVE_CXXFLAGS", "").split())
    parts += [" ".join(flags).encode(), compiler.encode(),
              importlib.metadata.version("jaxlib").encode(), platform.machine().encode(),
              _cpu_model().encode()]  # fmt: skip
    for part in parts:
        key.update(part)
        key.update(b"\0")
    cache_dir = _cache_dir() if cache_dir is None else cache_dir
    library = cache_dir / f"edl_native-{key.hexdigest()[:20]}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    command = [compiler, *flags, f"-I{include}", *map(str, _SOURCES), "-o", tmp]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"building edl's native kernels failed ({' '.join(command)}):\n"
                f"{done.stderr[-4000:]}"
            )
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
        library = ctypes.CDLL(str(build_library()))
    except (RuntimeError, OSError) as error:
        return f"the native CPU kernels are unavailable: {error}"
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return None


def unavailable() -> str | None:
    """None when the native kernels can run in this process (building them on first call),
    else the reason they cannot."""
    return _registered()
