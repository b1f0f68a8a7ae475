"""The one attention entry point, ``attention(q, k, v, ...)``, and its plain-jnp reference.

Layout as ``jax.nn.dot_product_attention``: q ``(batch, q_len, heads, head_dim)``, k/v
``(batch, kv_len, kv_heads, head_dim)``. GQA/MQA group query heads over their shared K/V head
(no repeated K/V is materialised). When ``q_len < kv_len`` the causal diagonal is aligned to
the end, as in HF (the queries are the last ``q_len`` positions).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from edl.kernels import flash_attention, native
from edl.kernels._common import KERNEL_DTYPES
from edl.ops.attention_xla import xla_attention
from edl.ops.sharding import BATCH, fit_spec

__all__ = [
    "IMPLS",
    "attention",
    "attention_mask",
    "masked_attention",
    "padding_segments",
    "reference_attention",
    "use_native",
]

IMPLS = ("auto", "pallas", "native", "xla", "reference", "cudnn")
_warned: set[str] = set()  # fallback reasons already reported
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
) -> Float[Array, "batch q_len heads head_dim"]:
    """Plain-jnp attention with float32 logits and softmax; rows with no visible key give 0."""
    mask = attention_mask(
        q.shape[1], k.shape[1], causal=causal, window=window, segment_ids=segment_ids
    )
    return masked_attention(q, k, v, mask, softcap=softcap, scale=scale)


def masked_softmax(
    logits: Float[Array, "*shape"], mask: Bool[Array, "*mask_shape"], *, axis: int
) -> Float[Array, "*shape"]:
    """Softmax of ``logits`` along ``axis`` over the entries where ``mask`` (broadcast to
    ``logits``) is True; masked entries, and rows with no visible entry, give 0."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=axis, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked rows
    weights = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=axis, keepdims=True)
    return weights / jnp.where(denom == 0, 1.0, denom)


def masked_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch_or_1 q_len kv_len"],
    *,
    softcap: float | None = None,
    scale: float | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Plain-jnp attention under an explicit ``mask`` (True = visible): float32 logits and
    softmax, rows with no visible key give 0. The definition every kernel is tested against."""
    d, kv_heads = q.shape[-1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = rearrange(q, "b q (kv g) d -> b q kv g d", kv=kv_heads)  # GQA: groups of heads
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    probs = masked_softmax(logits, mask[:, None, None], axis=-1)  # mask (batch|1, 1, 1, q, kv)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return rearrange(out, "b q kv g d -> b q (kv g) d").astype(q.dtype)


def _per_shard(kernel, q, k, v, q_ids, kv_ids):
    """Run the Pallas kernel once per shard under the current mesh (``jax.set_mesh``):
    batch split over dp/fsdp and heads over tp (when tp divides the kv heads), sequences
    whole. XLA cannot partition a kernel's custom call itself; without a mesh, one call."""

    def call(q, k, v, q_ids=None, kv_ids=None):
        return kernel(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return call(q, k, v, q_ids, kv_ids)
    heads = "tp" if k.shape[2] % dict(mesh.shape).get("tp", 1) == 0 else None
    head_spec = fit_spec(P(BATCH, None, heads, None), q.shape, mesh.shape, unknown_axes="drop")
    kv_spec = fit_spec(P(*head_spec), k.shape, mesh.shape, unknown_axes="drop")
    ids = [] if q_ids is None else [q_ids, kv_ids]
    id_spec = P(head_spec[0], None)
    return jax.shard_map(
        call, in_specs=(head_spec, kv_spec, kv_spec, *[id_spec] * len(ids)),
        out_specs=head_spec, check_vma=False,
    )(q, k, v, *ids)  # fmt: skip


def pallas_unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why the Pallas kernel cannot run on these inputs here, or None when it can."""
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        return f"edl's Pallas attention kernel has no lowering for backend {backend!r}"
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        return f"the Pallas kernel takes float32/bfloat16/float16 inputs, got {q.dtype}/{k.dtype}"
    if backend == "gpu" and q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} > 256 does not fit the GPU kernel's shared memory"
    return None


def use_native(
    impl: str,
    name: str,
    operands: tuple[jax.Array, ...],
    *,
    fallback: str,
    warned: set[str],
    eligible: bool = True,
) -> bool:
    """Whether ``impl`` means an ``edl.kernels.native`` kernel for a call of op ``name``:
    ``"native"`` always (raising, with the reason, when the kernel cannot run or
    ``operands`` are not all of one float32 / bfloat16 dtype); ``"auto"`` on a CPU backend
    when the call is ``eligible``, the operands fit and the kernel can run. When it cannot
    run, ``"auto"`` warns once per reason (kept in ``warned``) that ``fallback`` runs
    instead; ``EDL_NATIVE_KERNELS=0`` asked for that, so then it says nothing."""
    dtype = operands[0].dtype
    fits = dtype in native.DTYPES and all(x.dtype == dtype for x in operands)
    if impl == "native":
        reason = native.unavailable()
        if reason is None and not fits:
            got = "/".join(str(x.dtype) for x in operands)
            reason = f"it takes float32 or bfloat16 operands, got {got}"
        if reason is not None:
            raise ValueError(f"{name}: impl='native' cannot run: {reason}")
        return True
    if impl != "auto" or not eligible or jax.default_backend() != "cpu" or not fits:
        return False
    if native.turned_off():
        return False
    reason = native.unavailable()
    if reason is not None and reason not in warned:
        warned.add(reason)
        warnings.warn(f"edl {name}: {reason}; using impl={fallback!r}", stacklevel=3)
    return reason is None


def _cudnn_attention(q, k, v, *, causal, segment_ids, window, softcap, scale):
    """``jax.nn.dot_product_attention(implementation="cudnn")``: a GPU baseline."""
    if jax.default_backend() != "gpu":
        raise ValueError("attention: impl='cudnn' needs an NVIDIA GPU (cuDNN)")
    if softcap is not None:
        raise ValueError("attention: impl='cudnn' does not support softcap")
    q_len, kv_len = q.shape[1], k.shape[1]
    if segment_ids is None and window is None and q_len == kv_len:
        mask, is_causal = None, causal  # cuDNN's own causal mask: the fast path
    else:  # explicit mask: end-aligned diagonal, windows and segments as edl defines them
        mask = attention_mask(q_len, kv_len, causal=causal, window=window, segment_ids=segment_ids)
        mask, is_causal = mask[:, None], False
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=is_causal, implementation="cudnn"
    )


def attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    *,
    causal: bool = False,
    segment_ids: SegmentIds | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "batch q_len heads head_dim"]:
    """Multi-head attention; the single entry point every model calls.

    Args:
        q, k, v: see the module docstring; ``heads`` must be a multiple of ``kv_heads``.
        causal: mask future keys (diagonal aligned to the end when ``q_len < kv_len``).
        segment_ids: ``(batch, len)`` ids, or a ``(q_ids, kv_ids)`` pair; a query only sees
            keys of its own segment (packed sequences; id 0 can mark padding).
        window: left sliding window (Mistral); implies causal.
        softcap: ``softcap * tanh(logits / softcap)`` after scaling (Gemma 2).
        scale: logit scale, default ``1/sqrt(head_dim)``.
        impl: ``"pallas"`` (``edl.kernels.flash_attention``: Triton on GPU, interpreted on
            CPU), ``"native"`` (``edl.kernels.native.flash_attention_cpu``: a C++ kernel for
            CPU, float32 / bfloat16), ``"reference"`` (the plain-jnp definition tests compare
            against), ``"xla"`` (the reference's maths with a memory-saving hand-written
            backward), ``"cudnn"`` (``jax.nn.dot_product_attention``'s cuDNN kernel, GPU only,
            no softcap) or ``"auto"``: on a CPU backend the native kernel where it can run
            (else Pallas, warning once why; none with ``EDL_NATIVE_KERNELS=0``), elsewhere
            Pallas wherever it can run, otherwise ``"xla"`` with a one-time warning saying why
            (see :func:`pallas_unsupported`).
    """
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
    q_len, kv_len = q.shape[1], k.shape[1]
    q_ids, kv_ids = _segment_pair(segment_ids, q_len, kv_len)
    if use_native(impl, "attention", (q, k, v), fallback="pallas", warned=_warned):
        kernel = functools.partial(
            native.flash_attention_cpu, causal=causal, window=window, softcap=softcap,
            scale=scale,
        )  # fmt: skip
        return _per_shard(kernel, q, k, v, q_ids, kv_ids)
    if impl in ("auto", "pallas"):
        reason = pallas_unsupported(q, k)
        if reason is None:
            kernel = functools.partial(
                flash_attention, causal=causal, window=window, softcap=softcap, scale=scale
            )
            return _per_shard(kernel, q, k, v, q_ids, kv_ids)
        if impl == "pallas":
            raise ValueError(f"attention: impl='pallas' cannot run: {reason}")
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"edl attention: {reason}; using impl='xla'", stacklevel=2)
        impl = "xla"
    if impl == "reference":
        return reference_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, window=window, softcap=softcap,
            scale=scale,
        )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl == "cudnn":
        return _cudnn_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, window=window, softcap=softcap,
            scale=scale,
        )  # fmt: skip
    mask = attention_mask(q_len, kv_len, causal=causal, window=window, segment_ids=segment_ids)
    return xla_attention(q, k, v, mask, scale=scale, softcap=softcap)
