"""The one attention entry point, ``attention(q, k, v, ...)``, and its plain-jnp reference.

Layout as ``jax.nn.dot_product_attention``: q ``(batch, q_len, heads, head_dim)``, k/v
``(batch, kv_len, kv_heads, head_dim)``. GQA/MQA group query heads over their shared K/V head
(no repeated K/V is materialised). When ``q_len < kv_len`` the causal diagonal is aligned to
the end, as in HF (the queries are the last ``q_len`` positions).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from edl.kernels import flash_attention, native, tpu
from edl.kernels._common import KERNEL_DTYPES, triton_head_dim_reason
from edl.ops.attention_xla import xla_attention
from edl.ops.block_attention import BidirectionalBlocks
from edl.ops.dispatch import Kernel, by_platform, never
from edl.ops.ring_attention import ring_attention
from edl.ops.sharding import BATCH, fit_spec
from edl.platforms import carry_platforms

__all__ = ["IMPLS", "KERNELS", "attention", "attention_mask", "reference_attention"]

IMPLS = ("auto", "pallas", "native", "xla", "reference", "cudnn", "ring")
SegmentIds = Int[Array, "batch len"] | tuple[Int[Array, "batch q_len"], Int[Array, "batch kv_len"]]


def _segment_pair(segment_ids: SegmentIds | None, q_len: int, kv_len: int):
    if segment_ids is None:
        return None, None
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    if q_ids.shape[-1] != q_len or kv_ids.shape[-1] != kv_len:
        raise ValueError(
            f"segment_ids lengths {q_ids.shape[-1]}/{kv_ids.shape[-1]} do not match q_len "
            f"{q_len} / kv_len {kv_len}; pass a (q_ids, kv_ids) pair when they differ"
        )
    return q_ids, kv_ids


def padding_segments(
    attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> SegmentIds | None:
    """``(q_ids, kv_ids)`` for ``attention``'s ``segment_ids``: each query sees its own
    segment (``segment_ids``, default one segment per row) and no padded key (mask 0), as
    HF's padding mask does (padded queries still see the real keys). ``None`` when neither
    is given."""
    if attention_mask is None and segment_ids is None:
        return None
    if segment_ids is None:
        q_ids = jnp.ones(attention_mask.shape, jnp.int32)
    else:
        q_ids = segment_ids.astype(jnp.int32)
    if attention_mask is None:
        return q_ids, q_ids
    return q_ids, jnp.where(attention_mask.astype(jnp.bool_), q_ids, -1)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: SegmentIds | None = None,
) -> Bool[Array, "batch_or_1 q_len kv_len"]:
    """Which keys each query may attend to, ``(batch or 1, q_len, kv_len)``.

    ``window`` is a left window as in Mistral: query ``i`` sees keys ``j`` with
    ``0 <= i - j < window`` (``i`` in kv coordinates; implies ``causal``).
    """
    q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    k_pos = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), jnp.bool_)
    if causal or window is not None:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    q_ids, kv_ids = _segment_pair(segment_ids, q_len, kv_len)
    if q_ids is None:
        return mask[None]
    return mask[None] & (q_ids[:, :, None] == kv_ids[:, None, :])


def reference_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    *,
    causal: bool = False,
    segment_ids: SegmentIds | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Plain-jnp attention with float32 logits and softmax; rows with no visible key give 0."""
    mask = attention_mask(
        q.shape[1], k.shape[1], causal=causal, window=window, segment_ids=segment_ids
    )
    return masked_attention(q, k, v, mask, softcap=softcap, scale=scale, sinks=sinks)


def masked_softmax(
    logits: Float[Array, "*shape"],
    mask: Bool[Array, "*mask_shape"],
    *,
    axis: int,
    sink: Float[Array, "*sink_shape"] | None = None,
) -> Float[Array, "*shape"]:
    """Softmax of ``logits`` along ``axis`` over the entries where ``mask`` (broadcast to
    ``logits``) is True; masked entries, and rows with no visible entry, give 0.

    ``sink`` (broadcast to ``logits`` with ``axis`` of size 1): one more logit per row that
    joins the denominator but has no output entry (GPT-OSS's attention sinks), so a row's
    weights sum to less than 1."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=axis, keepdims=True)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink.astype(logits.dtype))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked rows
    weights = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=axis, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink.astype(logits.dtype) - row_max)
    return weights / jnp.where(denom == 0, 1.0, denom)


def grouped_sinks(
    sinks: Float[Array, " heads"] | None, kv_heads: int
) -> Float[Array, "kv_heads group"] | None:
    """Per-head sink logits ``(heads,)`` as ``(kv_heads, group)`` (GQA's grouping of heads),
    in float32 at least; ``ValueError`` unless there is one per query head."""
    if sinks is None:
        return None
    if sinks.ndim != 1 or sinks.shape[0] % kv_heads:
        raise ValueError(
            f"attention: sinks must be (heads,) for {kv_heads} kv heads, got {sinks.shape}"
        )
    dtype = jnp.float64 if sinks.dtype == jnp.float64 else jnp.float32
    return sinks.astype(dtype).reshape(kv_heads, -1)


def masked_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch_or_1 q_len kv_len"],
    *,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Plain-jnp attention under an explicit ``mask`` (True = visible): float32 logits and
    softmax (float64 for float64 inputs), rows with no visible key give 0. The definition
    every kernel is tested against.
    ``sinks``: one learned logit per query head in each row's softmax denominator
    (``masked_softmax``'s ``sink``; GPT-OSS)."""
    d, kv_heads = q.shape[-1], k.shape[2]
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"attention: sinks must be ({q.shape[2]},), got {sinks.shape}")
    sink = grouped_sinks(sinks, kv_heads)
    sink = None if sink is None else sink[None, :, :, None, None]  # (1, kv, g, 1, 1)
    scale = d**-0.5 if scale is None else scale
    qg = rearrange(q, "b q (kv g) d -> b q kv g d", kv=kv_heads)  # GQA: groups of heads
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32  # float64: gradient checks
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=acc) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    probs = masked_softmax(logits, mask[:, None, None], axis=-1, sink=sink)  # mask (b|1,1,1,q,kv)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=acc)
    return rearrange(out, "b q kv g d -> b q (kv g) d").astype(q.dtype)


def _per_shard(kernel, q, k, v, q_ids, kv_ids, sinks=None):
    """Run ``kernel(q, k, v, q_ids, kv_ids, sinks)`` once per shard under the current mesh
    (``jax.set_mesh``): batch split over dp/fsdp and heads over tp (when tp divides the kv
    heads), sequences whole. XLA cannot partition a kernel's custom call itself; without a
    mesh, one call."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q, k, v, q_ids, kv_ids, sinks)
    heads = "tp" if k.shape[2] % dict(mesh.shape).get("tp", 1) == 0 else None
    head_spec = fit_spec(P(BATCH, None, heads, None), q.shape, mesh.shape, unknown_axes="drop")
    kv_spec = fit_spec(P(*head_spec), k.shape, mesh.shape, unknown_axes="drop")
    ids = [] if q_ids is None else [q_ids, kv_ids]
    id_spec = P(head_spec[0], None)
    extra = [] if sinks is None else [sinks]  # split over heads as q is

    def per_shard(q, k, v, *rest):
        ids, sink = (rest[:2], rest[2:]) if q_ids is not None else ((None, None), rest)
        return kernel(q, k, v, *ids, sink[0] if sink else None)

    return jax.shard_map(
        carry_platforms(per_shard),
        in_specs=(
            head_spec,
            kv_spec,
            kv_spec,
            *[id_spec] * len(ids),
            *[P(head_spec[2])] * len(extra),
        ),
        out_specs=head_spec,
        check_vma=False,
    )(q, k, v, *ids, *extra)


@dataclasses.dataclass(frozen=True)
class _Options:
    """``attention``'s static settings, as every kernel of the table takes them."""

    causal: bool
    window: int | None
    softcap: float | None
    scale: float | None


def dtype_reason(name: str, dtypes: tuple, *arrays: jax.Array) -> str | None:
    """Why ``name`` cannot take ``arrays``' dtypes (one of ``dtypes``, all alike), or None."""
    got = [np.dtype(x.dtype) for x in arrays]
    if got[0] in dtypes and all(d == got[0] for d in got):
        return None
    want = "/".join(np.dtype(d).name for d in dtypes)
    return f"{name} takes {want} inputs, got {'/'.join(d.name for d in got)}"


def _no_sinks(name: str, sinks) -> str | None:
    """Why a kernel without attention sinks cannot take ``sinks``, or None."""
    return None if sinks is None else f"{name} has no attention sinks"


def _native_unsupported(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> str | None:
    return (
        native.unavailable()
        or _no_sinks("the native CPU kernel", sinks)
        or dtype_reason("the native CPU kernel", native.DTYPES, q, k, v)
    )


def _native(options: _Options, q, k, v, q_ids, kv_ids, sinks):
    return native.flash_attention_cpu(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **dataclasses.asdict(options)
    )


def _pallas_unsupported(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> str | None:
    return dtype_reason("the Pallas kernel", KERNEL_DTYPES, q, k, v)


def _no_sinks_given(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> bool:
    """``preferred`` of the interpreted kernel: "auto" takes it for sinks no further than the
    native kernel (on CPU, XLA's form is the faster one there)."""
    return sinks is None


def _triton_unsupported(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> str | None:
    reason = triton_head_dim_reason(q.shape[-1])
    return reason or _pallas_unsupported(options, q, k, v, q_ids, kv_ids, sinks)


def _tpu_unsupported(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> str | None:
    return dtype_reason("the TPU kernel", tpu.DTYPES, q, k, v)


def _pallas(interpret: bool):
    def call(options: _Options, q, k, v, q_ids, kv_ids, sinks):
        return flash_attention(
            q,
            k,
            v,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            sinks=sinks,
            interpret=interpret,
            **dataclasses.asdict(options),
        )

    return call


def _pallas_tpu(options: _Options, q, k, v, q_ids, kv_ids, sinks):
    return tpu.flash_attention(
        q,
        k,
        v,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        sinks=sinks,
        **dataclasses.asdict(options),
    )


def _cudnn_unsupported(options: _Options, q, k, v, q_ids, kv_ids, sinks) -> str | None:
    if "cuda" not in jax.extend.backend.backends():
        # jax looks for cuDNN while tracing, so only a process with CUDA can trace it.
        return "cuDNN attention is traced only where jax has a CUDA backend"
    if options.softcap is not None:
        return "cuDNN attention has no softcap"
    if sinks is not None:
        return "cuDNN attention has no attention sinks"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16/float16 inputs, got {q.dtype}"
    return None


def _cudnn(options: _Options, q, k, v, q_ids, kv_ids, sinks):
    """``jax.nn.dot_product_attention(implementation="cudnn")``: a GPU baseline."""
    q_len, kv_len = q.shape[1], k.shape[1]
    if q_ids is None and options.window is None and q_len == kv_len:
        mask, is_causal = None, options.causal  # cuDNN's own causal mask: the fast path
    else:  # explicit mask: end-aligned diagonal, windows and segments as edl defines them
        segments = None if q_ids is None else (q_ids, kv_ids)
        mask = attention_mask(
            q_len, kv_len, causal=options.causal, window=options.window, segment_ids=segments
        )
        mask, is_causal = mask[:, None], False
    scale = q.shape[-1] ** -0.5 if options.scale is None else options.scale
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=is_causal, implementation="cudnn"
    )


def _turned_off() -> bool:
    return native.turned_off()


_TRITON = Kernel("pallas", _pallas(interpret=False), _triton_unsupported)
# Per platform the kernels ``impl="auto"`` prefers, in order (edl.ops.dispatch): the native
# C++ kernel on CPU (the interpreted Pallas kernel where it cannot run), Pallas through Triton
# on GPUs and through Mosaic on TPUs; XLA (``xla_attention``) where none can.
KERNELS: dict[str, tuple[Kernel, ...]] = {
    "cpu": (
        Kernel("native", _native, _native_unsupported, quiet=_turned_off),
        Kernel("pallas", _pallas(interpret=True), _pallas_unsupported, preferred=_no_sinks_given),
    ),
    "cuda": (_TRITON, Kernel("cudnn", _cudnn, _cudnn_unsupported, preferred=never)),  # by name
    "rocm": (_TRITON,),
    "tpu": (Kernel("pallas", _pallas_tpu, _tpu_unsupported),),
}


def attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    *,
    causal: bool = False,
    segment_ids: SegmentIds | BidirectionalBlocks | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    impl: str = "auto",
) -> Float[Array, "batch q_len heads head_dim"]:
    """Multi-head attention; the single entry point every model calls.

    Args:
        q, k, v: see the module docstring; ``heads`` must be a multiple of ``kv_heads``.
        causal: mask future keys (diagonal aligned to the end when ``q_len < kv_len``).
        segment_ids: ``(batch, len)`` ids, or a ``(q_ids, kv_ids)`` pair; a query only sees
            keys of its own segment (packed sequences; id 0 can mark padding). A
            ``edl.ops.block_attention.BidirectionalBlocks`` also opens each block both ways
            (Gemma 3's images), computed by the XLA path whatever ``impl`` says.
        window: left sliding window (Mistral); implies causal.
        softcap: ``softcap * tanh(logits / softcap)`` after scaling (Gemma 2).
        scale: logit scale, default ``1/sqrt(head_dim)``.
        sinks: attention sinks (GPT-OSS), one learned logit per query head that joins every
            row's softmax denominator and has no value (``masked_softmax``'s ``sink``).
            Differentiable. The Pallas kernels take them (GPU and TPU, around the unchanged
            kernels); the native CPU and cuDNN kernels have none: ``"auto"`` computes with
            ``"xla"`` there, warning why (on CPU ``"auto"`` does not fall to the interpreted
            Pallas kernel for them either).
        impl: which implementation computes it:

            - ``"auto"``: per platform the program is lowered for, the first kernel of
              :data:`KERNELS` that can take these inputs, else ``"xla"``, warning once (when
              lowered) why: on CPU the native C++ kernel, else the interpreted Pallas kernel
              (no warning with ``EDL_NATIVE_KERNELS=0``); on GPUs the Pallas kernel through
              Triton; on TPUs the Pallas kernel through Mosaic (``edl.kernels.tpu``).
            - ``"pallas"``: the Pallas kernel of the platform (``edl.kernels.flash_attention``:
              Triton on GPU, interpreted on CPU; ``edl.kernels.tpu.flash_attention`` on TPU).
            - ``"native"``: ``edl.kernels.native.flash_attention_cpu``, a C++ kernel for CPU
              (float32 / bfloat16).
            - ``"cudnn"``: ``jax.nn.dot_product_attention``'s cuDNN kernel (NVIDIA GPUs, no
              softcap).
            - ``"xla"``: the reference's maths with a memory-saving hand-written backward.
            - ``"reference"``: the plain-jnp definition tests compare against.
            - ``"ring"``: context parallelism, ``edl.ops.ring_attention`` over the ``sp``
              axis of the mesh set by ``jax.set_mesh`` (self-attention, no sinks; tokens in
              sequence order). The cached decode ops take their ``"auto"`` choice for it.

            A kernel named that cannot run on the platform a program is lowered for raises
            ``ValueError`` when lowered (at once, when it runs nowhere).
    """
    _check_arguments(q, k, v, window, impl, sinks)
    if isinstance(segment_ids, BidirectionalBlocks):  # Gemma 3's images: XLA with their mask
        options = dict(causal=causal, window=window, softcap=softcap, scale=scale, sinks=sinks)
        return segment_ids.attend(q, k, v, **options)
    q_len, kv_len = q.shape[1], k.shape[1]
    q_ids, kv_ids = _segment_pair(segment_ids, q_len, kv_len)
    if impl == "ring":
        if sinks is not None:
            raise ValueError("attention: impl='ring' takes no sinks")
        return _ring(q, k, v, q_ids, causal=causal, window=window, softcap=softcap, scale=scale)
    if impl == "reference":
        return reference_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=segment_ids,
            window=window,
            softcap=softcap,
            scale=scale,
            sinks=sinks,
        )
    options = _Options(causal=causal, window=window, softcap=softcap, scale=scale)

    def plain(q, k, v, q_ids, kv_ids, sinks):
        segments = None if q_ids is None else (q_ids, kv_ids)
        mask = attention_mask(q_len, kv_len, causal=causal, window=window, segment_ids=segments)
        logit_scale = q.shape[-1] ** -0.5 if scale is None else scale
        return xla_attention(q, k, v, mask, scale=logit_scale, softcap=softcap, sinks=sinks)

    if impl == "xla":
        return plain(q, k, v, q_ids, kv_ids, sinks)

    def kernel(q, k, v, q_ids, kv_ids, sinks):
        arrays = (q, k, v, q_ids, kv_ids, sinks)
        return by_platform("attention", impl, KERNELS, options, arrays, fallback=plain)

    return _per_shard(kernel, q, k, v, q_ids, kv_ids, sinks)


def _ring(q, k, v, q_ids, *, causal, window, softcap, scale):
    """``impl="ring"``: self-attention only (one sequence sharded over ``sp``)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"attention: impl='ring' is self-attention, got q_len {q.shape[1]} and kv_len "
            f"{k.shape[1]}"
        )
    return ring_attention(
        q, k, v, causal=causal, window=window, segment_ids=q_ids, softcap=softcap, scale=scale
    )


def _check_arguments(q, k, v, window: int | None, impl: str, sinks) -> None:
    """``attention``'s argument checks: errors name the shapes or values at fault."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects 4-d q/k/v, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} kv heads"
        )
    if window is not None and window <= 0:
        raise ValueError(f"attention: window must be positive, got {window}")
    if impl not in IMPLS:
        raise ValueError(f"attention: unknown impl {impl!r}; available: {IMPLS}")
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"attention: sinks must be ({q.shape[2]},), got {sinks.shape}")
