"""Native CPU kernels: paged attention that reads the page pool in place, and blocked
attention with its backward pass for training.

Why edl keeps C++ kernels here. On CPU, Pallas only interprets kernels (each grid step a
loop of small XLA ops), and XLA alone cannot do what these two need:

- **Paged attention** (serving). XLA has no way to read a row's scattered pages without
  first gathering them into a contiguous copy (it fuses no gather into a dot). In a 16-row
  serving decode step that copy made attention half the step (``benchmarks/RESULTS.md``,
  "serve: where a 16-row decode step's time goes"). ``paged_attention.cc`` walks each row's
  page table and reads keys and values where they lie; quantized pages (an int8 / fp8 KV
  cache, ``edl.ops.kv_quant``) through a second entry that dequantizes each position it
  reads.
- **Blocked attention for training** (``flash_attention.cc``). XLA materialises each head's
  ``(q_len, kv_len)`` logits and probabilities in memory several times over the forward and
  backward passes, and the interpreted Pallas kernel pays for its loop; in a small Llama's
  train step (4 layers, batch 4 x 256, head_dim 32) attention was ~40% of the step either way
  (``benchmarks/RESULTS.md``, "train step: attention on CPU"). The kernel keeps a block of
  logits in cache, skips key blocks the causal or sliding-window mask hides, and recomputes
  probabilities in the backward pass from each row's log-sum-exp (the FlashAttention-2
  scheme).

Both split their work over items on XLA's intra-op thread pool, through XLA's FFI
(``jax.ffi``). The sources are compiled on first use with the machine's C++ compiler
(``$CXX``, else ``c++`` or ``g++``) against the headers jaxlib ships
(``jax.ffi.include_dir()``), for this CPU (``-march=native``; ``$EDL_NATIVE_CXXFLAGS`` adds
flags after edl's, e.g. ``-march=x86-64-v3`` for a library that other machines load), into
one library in a cache directory (``$EDL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/edl/kernels``
or ``~/.cache/edl/kernels``), keyed by the sources, the flags, jaxlib's version and the CPU;
later processes load the cached library. The cache is private (created 0700): each library
is written atomically with a JSON record of its SHA-256 and key, and verified against it
before it is loaded (then checked for the kernels' symbols); one that fails is rebuilt.
Where no compiler is found, the build fails, a library fails its checks and cannot be
rebuilt, or the cache directory or a file in it belongs to another user or is writable by
its group or others (refused: they could plant code), :func:`unavailable` says why, naming
the file, and callers fall back, warning once (paged attention to XLA's gathered form,
``edl.ops.attention`` to the interpreted Pallas kernel). ``EDL_NATIVE_KERNELS=0`` turns the
kernels off.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, Shaped

from edl.kernels.native._build import build_library, turned_off, unavailable
from edl.kernels.native._cache import UnsafeCacheError

__all__ = [
    "ATTENTION_LSE",
    "ATTENTION_OUT",
    "CODE_DTYPES",
    "DTYPES",
    "UnsafeCacheError",
    "build_library",
    "flash_attention_cpu",
    "paged_attention_cpu",
    "turned_off",
    "unavailable",
]

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the kernel takes
CODE_DTYPES = (np.dtype(jnp.int8), np.dtype(jnp.float8_e4m3fn))  # quantized pools' codes


def _check_operands(what: str, *arrays: Array) -> None:
    """Raise unless the kernels can run here (``RuntimeError``, saying why) and ``arrays``
    share one dtype the kernels take (``ValueError`` naming ``what`` and the dtypes)."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    dtypes = [np.dtype(x.dtype) for x in arrays]
    if dtypes[0] not in DTYPES or any(d != dtypes[0] for d in dtypes):
        raise ValueError(
            f"{what} must share float32 or bfloat16, got {', '.join(map(str, dtypes))}"
        )


def paged_attention_cpu(
    q: Float[Array, "batch new_tokens heads head_dim"],
    k_pages: Shaped[Array, "layers num_pages page_size kv_heads head_dim"],
    v_pages: Shaped[Array, "layers num_pages page_size kv_heads head_dim"],
    page_table: Int[Array, "batch pages_per_seq"],
    lengths: Int[Array, " batch"],
    layer: Int[Array, ""] | int,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
    v_scales: Float[Array, "*_layers _num_pages _page_size _kv_heads _one"] | None = None,
) -> Float[Array, "batch new_tokens heads head_dim"]:
    """``edl.ops.paged_attention``'s maths (``cache_mask`` + ``masked_attention`` over each
    row's gathered pages) with the pools read in place at ``layer``: row ``b``'s query ``i``
    sits at position ``lengths[b] - new_tokens + i``. float32 or bfloat16, the same for ``q``
    and the pools. CPU only; call :func:`unavailable` first. Meant for a few new tokens per
    row (decode steps): its inner loops are scalar code over one key at a time, so long
    prompt chunks are faster through XLA's GEMMs. Not differentiable.

    Quantized pools (``edl.ops.kv_quant``, an int8 / fp8 cache): ``k_pages`` / ``v_pages``
    hold int8 or float8_e4m3fn codes and ``k_scales`` / ``v_scales`` their float32 scales,
    one per token and kv head; the kernel dequantizes each position it reads
    (``code * scale`` in float32, before the dot and the value sum), never the pool."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("paged_attention_cpu: pass both k_scales and v_scales or neither")
    ints = (page_table.astype(jnp.int32), lengths.astype(jnp.int32), jnp.asarray(layer, jnp.int32))
    attrs = dict(
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0), window=np.int64(window or 0)
    )
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if k_scales is None:
        _check_operands("paged_attention_cpu: q and pools", q, k_pages, v_pages)
        return jax.ffi.ffi_call("edl_paged_attention", out)(q, k_pages, v_pages, *ints, **attrs)
    _check_operands("paged_attention_cpu: q", q)
    _check_quantized(k_pages, v_pages, k_scales, v_scales)
    call = jax.ffi.ffi_call("edl_paged_attention_quantized", out)
    scales = (k_scales.astype(jnp.float32), v_scales.astype(jnp.float32))
    return call(q, k_pages, v_pages, *scales, *ints, **attrs)


def _check_quantized(k_pages, v_pages, k_scales, v_scales) -> None:
    """Codes of one :data:`CODE_DTYPES` dtype and scales of the pools' shape with a last
    dim of 1 (``ValueError`` naming the dtypes or shapes)."""
    codes = [np.dtype(x.dtype) for x in (k_pages, v_pages)]
    if codes[0] not in CODE_DTYPES or codes[1] != codes[0]:
        raise ValueError(
            f"paged_attention_cpu: quantized pools must share int8 or float8_e4m3fn codes, "
            f"got {codes[0]}, {codes[1]}"
        )
    want = (*k_pages.shape[:-1], 1)
    for name, x in (("v_pages", v_pages), ("k_scales", k_scales), ("v_scales", v_scales)):
        expected = k_pages.shape if name == "v_pages" else want
        if tuple(x.shape) != tuple(expected):
            raise ValueError(
                f"paged_attention_cpu: {name} must have shape {expected}, got {x.shape}"
            )


ATTENTION_OUT = "edl_attention_out"  # checkpoint names of the kernel's forward results
ATTENTION_LSE = "edl_attention_lse"


class _Options(NamedTuple):  # static: hashable, part of the custom_vjp's signature
    causal: bool
    window: int
    softcap: float
    scale: float


def _attrs(options: _Options) -> dict:
    return {
        "scale": np.float32(options.scale),
        "softcap": np.float32(options.softcap),
        "window": np.int64(options.window),
        "causal": bool(options.causal),
    }


def _forward(q, k, v, q_ids, kv_ids, options):
    batch, q_len, heads, _ = q.shape
    call = jax.ffi.ffi_call(
        "edl_flash_attention_forward",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
        ),
        vmap_method="sequential",
    )
    return call(q, k, v, q_ids, kv_ids, **_attrs(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_ids, kv_ids, options):
    return _forward(q, k, v, q_ids, kv_ids, options)[0]


def _flash_fwd(q, k, v, q_ids, kv_ids, options):
    out, lse = _forward(q, k, v, q_ids, kv_ids, options)
    # Named for remat policies (edl.nn.stack's "dots" saves them): recomputing the kernel's
    # forward costs more than keeping its output and one float per query row.
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, q_ids, kv_ids, out, lse)


def _flash_bwd(options, residuals, d_out):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    call = jax.ffi.ffi_call(
        "edl_flash_attention_backward",
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="sequential",
    )
    dq, dk, dv = call(q, k, v, q_ids, kv_ids, out, lse, d_out.astype(q.dtype), **_attrs(options))
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_cpu(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    *,
    causal: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    q_segment_ids: Int[Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[Array, "batch kv_len"] | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """``edl.ops.attention``'s maths (``attention_mask`` + ``masked_attention``) as a blocked
    C++ kernel with a matching backward pass (``jax.custom_vjp``), for CPU training.

    float32 sums and softmax; float32 or bfloat16 operands, one dtype for ``q``, ``k`` and
    ``v``; GQA as in ``edl.ops.attention`` (``heads`` a multiple of ``kv_heads``). ``window``
    implies ``causal``. Segment ids: a query sees only keys of its own id (both or neither).
    CPU only; call :func:`unavailable` first. Differentiable in ``q``, ``k``, ``v``.
    """
    _check_operands("flash_attention_cpu: q, k, v", q, k, v)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "flash_attention_cpu: pass both q_segment_ids and kv_segment_ids or neither"
        )
    if q_segment_ids is None:
        q_ids = kv_ids = jnp.zeros((0,), jnp.int32)  # empty: no segments
    else:
        q_ids, kv_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    options = _Options(
        causal=bool(causal or window is not None),
        window=int(window or 0),
        softcap=float(softcap or 0.0),
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
    )
    return _flash(q, k, v, q_ids, kv_ids, options)
