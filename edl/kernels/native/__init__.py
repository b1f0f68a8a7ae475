"""A native CPU kernel: paged attention that reads the page pool in place.

Why edl keeps a C++ kernel here. On CPU, XLA has no way to read a row's scattered pages
without first gathering them into a contiguous copy (it fuses no gather into a dot), and
Pallas only interprets kernels there. In a 16-row serving decode step that copy made
attention half the step (``benchmarks/RESULTS.md``, "serve: where a 16-row decode step's time
goes"). ``paged_attention.cc`` walks each row's page table and reads keys and values where
they lie, split over (row, kv head) items on XLA's intra-op thread pool, through XLA's FFI
(``jax.ffi``).

The source is compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++``
or ``g++``) against the headers jaxlib ships (``jax.ffi.include_dir()``), for this CPU
(``-march=native``), into a cache directory (``$EDL_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/edl/kernels`` or ``~/.cache/edl/kernels``), keyed by the source, the flags,
jaxlib's version and the CPU; later processes load the cached library. Where no compiler is
found or the build fails, :func:`unavailable` says why and callers fall back to XLA
(``edl.ops.paged_attention`` warns once). ``EDL_NATIVE_KERNELS=0`` turns the kernel off.
"""

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
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["DTYPES", "build_library", "paged_attention_cpu", "turned_off", "unavailable"]

_SOURCE = Path(__file__).with_name("paged_attention.cc")
_TARGET = "edl_paged_attention"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


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
    """Compile ``paged_attention.cc`` into ``cache_dir`` (default: the module docstring's),
    unless a library built from the same source, flags, jaxlib and CPU is there already.
    Returns its path; raises ``RuntimeError`` naming the compiler command and its output if
    the build fails. The library is written to a temporary file and renamed, so concurrent
    processes never load a half-written one."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(),
                 importlib.metadata.version("jaxlib").encode(), platform.machine().encode(),
                 _cpu_model().encode()):  # fmt: skip
        key.update(part)
        key.update(b"\0")
    cache_dir = _cache_dir() if cache_dir is None else cache_dir
    library = cache_dir / f"paged_attention-{key.hexdigest()[:20]}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    command = [compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"building {_SOURCE.name} failed ({' '.join(command)}):\n{done.stderr[-4000:]}"
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
    """Build (or find) the library and register its handler with XLA once per process;
    None when ready, else why not."""
    if turned_off():
        return "turned off by EDL_NATIVE_KERNELS=0"
    try:
        library = ctypes.CDLL(str(build_library()))
    except (RuntimeError, OSError) as error:
        return f"the native CPU kernel is unavailable: {error}"
    capsule = jax.ffi.pycapsule(library.EdlPagedAttention)
    jax.ffi.register_ffi_target(_TARGET, capsule, platform="cpu")
    return None


def unavailable() -> str | None:
    """None when the native kernel can run in this process (building it on first call), else
    the reason it cannot."""
    return _registered()


DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the kernel takes


def paged_attention_cpu(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    layer: Int[Array, ""] | int,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``edl.ops.paged_attention``'s maths (``cache_mask`` + ``masked_attention`` over each
    row's gathered pages) with the pools read in place at ``layer``: row ``b``'s query ``i``
    sits at position ``lengths[b] - new_tokens + i``. float32 or bfloat16, the same for ``q``
    and the pools. CPU only; call :func:`unavailable` first. Meant for a few new tokens per
    row (decode steps): its inner loops are scalar code over one key at a time, so long
    prompt chunks are faster through XLA's GEMMs. Not differentiable."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if q.dtype not in DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(
            f"paged_attention_cpu: q and pools must share float32 or bfloat16, got "
            f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0),
        window=np.int64(window or 0),
    )  # fmt: skip
