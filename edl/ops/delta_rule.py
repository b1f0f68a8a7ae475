"""The gated delta rule (Gated DeltaNet's linear attention, Qwen3-Next's ``linear_attention``
layers) as pure array functions: the recurrent reference, the chunked form, the one-token
decode step and the dispatch over them.

Per head, with a state ``S`` of ``(dk, dv)`` and, at each step ``t``, a query ``q_t``, a key
``k_t`` (both ``dk``), a value ``v_t`` (``dv``), a log-decay ``g_t <= 0`` and a write
strength ``beta_t`` in ``(0, 1)``::

    S   = exp(g_t) * S
    S  += k_t (beta_t * (v_t - S^T k_t))^T      # the delta rule: write the correction
    o_t = S^T (scale * q_t)

``scale`` is ``dk ** -0.5`` (transformers' ``torch_recurrent_gated_delta_rule``; edl's
callers L2-normalise q and k before, as its ``use_qk_l2norm_in_kernel``).

The chunked form (``chunked_gated_delta_rule``) is transformers'
``torch_chunk_gated_delta_rule``: the sequence is cut into chunks of 64; within a chunk the
delta-rule updates condense, by the WY / UT transform (one unit-lower-triangular inverse per
chunk, all chunks at once), into matmuls (``chunk_inputs``), and only the state passes from
chunk to chunk (``edl.kernels.delta_rule.chunk_scan_xla``: ``seq / 64`` sequential steps of
a few small matmuls each, instead of ``seq`` steps). Padding to a multiple of the chunk uses
``g = 0`` and ``beta = k = 0``, which leave the state as it is, so the final state is exact
for any length.
``edl.kernels.delta_rule`` runs that scan as one Pallas program per (batch, head) on GPU,
its backward too (``edl.kernels.delta_rule_bwd``); ``edl.kernels.tpu.delta_rule`` as Mosaic
kernels (forward and backward) on TPU.

Packed sequences: ``resets`` ``(batch, seq)`` marks the tokens that start a new sequence;
the state before such a token is dropped (as if ``exp(g_t)`` were 0), so each segment runs
from a zero state exactly as alone. The chunked form masks, within each chunk, the pairs
of positions that a reset separates and the incoming state after a reset; the scan (and
its kernel) is unchanged.

Everything computes in float32 at least (float64 inputs stay float64: the gradient checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from edl.kernels.delta_rule import chunk_scan_xla, pallas_chunk_scan
from edl.kernels.tpu.delta_rule import tpu_chunk_scan
from edl.platforms import fail_when_lowered, platform_dependent

__all__ = [
    "CHUNK_SIZE",
    "DELTA_RULE_IMPLS",
    "chunk_inputs",
    "chunked_gated_delta_rule",
    "gated_delta_rule",
    "gated_delta_step",
    "recurrent_gated_delta_rule",
]

CHUNK_SIZE = 64  # transformers' and flash-linear-attention's chunk

QK = Float[Array, "batch seq heads dk"]
V = Float[Array, "batch seq heads dv"]
Gates = Float[Array, "batch seq heads"]
State = Float[Array, "batch heads dk dv"]
Resets = Bool[Array, "batch seq"]


def _compute_dtype(*xs: jax.Array) -> jnp.dtype:
    # float64 when any input is (the gradient checks), else float32: no mixed-dtype
    # promotion, which strict promotion refuses.
    wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in xs)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _zero_state(q: jax.Array, v: jax.Array, dtype) -> jax.Array:
    b, _, h, dk = q.shape
    return jnp.zeros((b, h, dk, v.shape[-1]), dtype)


def gated_delta_step(
    q: Float[Array, "batch heads dk"],
    k: Float[Array, "batch heads dk"],
    v: Float[Array, "batch heads dv"],
    g: Float[Array, "batch heads"],
    beta: Float[Array, "batch heads"],
    state: State,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "batch heads dv"], State]:
    """One token of the recurrence (the decode step): its output and the new state, both in
    the state's dtype. ``scale`` defaults to ``dk ** -0.5``."""
    dt = state.dtype
    q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = state * jnp.exp(g)[..., None, None]
    memory = jnp.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - memory) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("bhkv,bhk->bhv", state, q * scale)
    return out, state


def recurrent_gated_delta_rule(
    q: QK,
    k: QK,
    v: V,
    g: Gates,
    beta: Gates,
    initial_state: State | None = None,
    resets: Resets | None = None,
    *,
    scale: float | None = None,
) -> tuple[V, State]:
    """The reference: ``gated_delta_step`` over time (``lax.scan``), the state zeroed
    before each token ``resets`` marks. Returns the output ``(batch, seq, heads, dv)`` in
    ``v``'s dtype and the final state (compute dtype)."""
    dt = _compute_dtype(q, k, v, g, beta)
    state = _zero_state(q, v, dt) if initial_state is None else initial_state.astype(dt)
    if resets is None:
        resets = jnp.zeros(q.shape[:2], jnp.bool_)

    def step(s, xs):
        *xs, reset = xs
        s = jnp.where(reset[:, None, None, None], jnp.zeros((), s.dtype), s)
        out, s = gated_delta_step(*xs, s, scale=scale)
        return s, out

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state


def _unit_lower_inverse(strict: jax.Array, eye: jax.Array) -> jax.Array:
    """``(I + strict)^-1`` of strictly lower ``(..., C, C)`` matrices by forward substitution
    row by row (transformers' export path), as matmuls. Not ``lax.linalg.triangular_solve``:
    its batched CPU kernel (LAPACK through jaxlib's ``ParallelBatchMap``) deadlocked inside a
    scanned, differentiated train step on the 2-core VM."""
    t = -strict

    def row(i, t):
        r = jax.lax.dynamic_index_in_dim(t, i, axis=-2, keepdims=True)  # (..., 1, C)
        r = r + jnp.einsum("...ik,...kj->...ij", r, t)  # rows < i are already final
        return jax.lax.dynamic_update_index_in_dim(t, r, i, axis=-2)

    return jax.lax.fori_loop(1, strict.shape[-1], row, t) + eye


def chunk_inputs(
    q: QK,
    k: QK,
    v: V,
    g: Gates,
    beta: Gates,
    *,
    chunk: int,
    scale: float,
    resets: Resets | None = None,
):
    """Everything the chunked form computes in parallel over chunks (transformers'
    ``torch_chunk_gated_delta_rule`` up to its loop), heads-major, the sequence padded to a
    multiple of ``chunk`` and cut into ``n`` chunks:

    ``qd`` ``(b, h, n, C, dk)`` queries decayed from the chunk's start, ``kd`` keys decayed
    to its end, ``u`` ``(b, h, n, C, dv)`` and ``w`` ``(b, h, n, C, dk)`` the UT-transformed
    values and decayed keys (``T = (I + tril(beta k k^T * D, -1))^-1``), ``attn``
    ``(b, h, n, C, C)`` the causal decayed ``q k^T`` within the chunk, ``decay``
    ``(b, h, n)`` the whole chunk's decay. ``resets``: the decays across a reset are 0
    (``_reset_masks``)."""
    dt = _compute_dtype(q, k, v, g, beta)
    seq = q.shape[1]
    pad = -seq % chunk
    heads_major = lambda x: jnp.swapaxes(x.astype(dt), 1, 2)  # (b, h, s, ...)
    q, k, v, g, beta = (heads_major(x) for x in (q, k, v, g, beta))
    widths = lambda x: [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)
    q, k, v, g, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
    b, h, s, _ = q.shape
    n = s // chunk
    cut = lambda x: x.reshape(b, h, n, chunk, *x.shape[3:])
    q, k, v, g, beta = (cut(x) for x in (q * scale, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # (b, h, n, C): log decay from the chunk's start
    grid = (b, h, n, chunk, chunk)
    lower = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), grid)
    from_start, to_end = jnp.exp(cum), jnp.exp(cum[..., -1:] - cum)
    decay = jnp.exp(cum[..., -1])
    if resets is not None:
        padded = jnp.pad(resets, [(0, 0), (0, pad)])
        same, live, last = _reset_masks(padded, b, n, chunk, dt)
        lower = lower & same
        from_start, to_end = from_start * live, to_end * last
        decay = decay * live[..., -1]
    # exp(cum_i - cum_j) for j <= i; the masked entries never reach exp (no overflow).
    diff = jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    pair = jnp.exp(diff)
    k_beta = k * beta[..., None]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pair
    eye = jnp.broadcast_to(jnp.eye(chunk, dtype=dt), grid)
    inverse = _unit_lower_inverse(jnp.where(lower & (eye == 0), system, 0), eye)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * from_start[..., None]], axis=-1)
    solved = jnp.einsum("...ij,...jd->...id", inverse, rhs)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    attn = jnp.einsum("...ik,...jk->...ij", q, k) * pair
    qd = q * from_start[..., None]
    kd = k * to_end[..., None]
    return qd, kd, u, w, attn, decay


def _reset_masks(resets: Bool[Array, "b s"], b: int, n: int, chunk: int, dtype):
    """Per chunk, from the (padded) ``resets``: ``same`` ``(b, 1, n, C, C)``, no reset
    between positions ``j < i`` (``j``'s writes reach ``i``); ``live`` ``(b, 1, n, C)``, no
    reset up to ``i`` (the incoming state reaches it); ``last``, no reset after ``i``
    (its writes reach the chunk's end). ``live`` / ``last`` as 0 / 1 in ``dtype``."""
    part = jnp.cumsum(resets.reshape(b, 1, n, chunk).astype(jnp.int32), axis=-1)
    same = part[..., :, None] == part[..., None, :]
    live, last = part == 0, part == part[..., -1:]
    return same, live.astype(dtype), last.astype(dtype)


def _unchunk(out: jax.Array, seq: int, dtype) -> jax.Array:
    b, h, n, c, dv = out.shape
    return jnp.swapaxes(out.reshape(b, h, n * c, dv)[:, :, :seq], 1, 2).astype(dtype)


def chunked_gated_delta_rule(
    q: QK,
    k: QK,
    v: V,
    g: Gates,
    beta: Gates,
    initial_state: State | None = None,
    resets: Resets | None = None,
    *,
    scale: float | None = None,
    chunk: int = CHUNK_SIZE,
    scan=chunk_scan_xla,
) -> tuple[V, State]:
    """The chunked form (same results as ``recurrent_gated_delta_rule`` up to rounding).
    ``scan``: ``edl.kernels.delta_rule.chunk_scan_xla`` (the state through the chunks as a
    ``lax.scan``) or a kernel with its signature."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    parts = chunk_inputs(q, k, v, g, beta, chunk=chunk, scale=scale, resets=resets)
    dt = parts[0].dtype
    state = _zero_state(q, v, dt) if initial_state is None else initial_state.astype(dt)
    out, state = scan(*parts, state)
    return _unchunk(out, q.shape[1], v.dtype), state


def _pallas(*args, interpret: bool | None = None, **kw):
    scan = functools.partial(pallas_chunk_scan, interpret=interpret)
    return chunked_gated_delta_rule(*args, **kw, scan=scan)


def _mosaic(*args, interpret=False, **kw):
    scan = functools.partial(tpu_chunk_scan, interpret=interpret)
    return chunked_gated_delta_rule(*args, **kw, scan=scan)


def _pallas_or_fail(*args, **kw):
    fallback = functools.partial(chunked_gated_delta_rule, **kw)

    def unsupported(*a):
        message = (
            "gated_delta_rule: impl 'pallas' runs on GPUs and TPUs only (use 'auto' or 'chunked')"
        )
        return jax.tree.map(lambda x: fail_when_lowered(x, message), fallback(*a))

    pallas = functools.partial(_pallas, **kw)
    tpu = functools.partial(_mosaic, **kw)
    return platform_dependent(*args, cuda=pallas, rocm=pallas, tpu=tpu, default=unsupported)


def _auto(*args, **kw):
    # GPU: the Pallas (Triton) chunk scan; TPU: the Mosaic one; both with their kernel
    # backward. CPU: the XLA chunked form (an interpreted kernel would be slower).
    return platform_dependent(
        *args,
        cuda=functools.partial(_pallas, **kw),
        rocm=functools.partial(_pallas, **kw),
        tpu=functools.partial(_mosaic, **kw),
        default=functools.partial(chunked_gated_delta_rule, **kw),
    )


_IMPLS = {
    "auto": _auto,
    "chunked": chunked_gated_delta_rule,
    "recurrent": recurrent_gated_delta_rule,
    "pallas": _pallas_or_fail,
    "pallas_interpret": lambda *a, **kw: _pallas(*a, **kw, interpret=True),
    "pallas_tpu_interpret": lambda *a, **kw: _mosaic(*a, **kw, interpret=True),
}
DELTA_RULE_IMPLS = tuple(_IMPLS)


def gated_delta_rule(
    q: QK,
    k: QK,
    v: V,
    g: Gates,
    beta: Gates,
    initial_state: State | None = None,
    *,
    scale: float | None = None,
    impl: str = "auto",
    resets: Resets | None = None,
) -> tuple[V, State]:
    """The gated delta rule over a sequence: output ``(batch, seq, heads, dv)`` (``v``'s
    dtype) and final state ``(batch, heads, dk, dv)``. ``resets`` ``(batch, seq)``: the
    tokens that start a packed sequence (the state before them is dropped).

    ``impl``: ``"auto"`` (Pallas on GPUs, Triton, and TPUs, Mosaic, forward and backward;
    the XLA chunked form elsewhere), ``"chunked"``, ``"recurrent"`` (the reference),
    ``"pallas"`` (GPUs and TPUs only: lowering it elsewhere raises), ``"pallas_interpret"``
    / ``"pallas_tpu_interpret"`` (the Triton / Mosaic kernels interpreted, for tests)."""
    if impl not in _IMPLS:
        raise ValueError(f"gated_delta_rule: impl must be one of {DELTA_RULE_IMPLS}, got {impl!r}")
    if q.shape != k.shape or q.shape[:3] != v.shape[:3] or g.shape != q.shape[:3]:
        raise ValueError(
            f"gated_delta_rule: q {q.shape} and k {k.shape} must be (batch, seq, heads, dk), "
            f"v {v.shape} (batch, seq, heads, dv), g {g.shape} and beta {beta.shape} "
            "(batch, seq, heads)"
        )
    if beta.shape != g.shape:
        raise ValueError(f"gated_delta_rule: beta {beta.shape} must match g {g.shape}")
    if resets is not None and resets.shape != q.shape[:2]:
        raise ValueError(
            f"gated_delta_rule: resets {resets.shape} must be (batch, seq) {q.shape[:2]}"
        )
    if initial_state is None:
        initial_state = _zero_state(q, v, _compute_dtype(q, k, v, g, beta))
    resets = None if resets is None else resets.astype(jnp.bool_)
    return _IMPLS[impl](q, k, v, g, beta, initial_state, resets, scale=scale)
