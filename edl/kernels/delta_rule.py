"""The sequential part of the chunked gated delta rule (``edl.ops.delta_rule``) in Pallas.

The chunked form splits into work parallel over chunks (the WY / UT transform: matmuls and
one triangular solve per chunk, left to XLA by ``edl.ops.delta_rule.chunk_inputs``) and the
pass of the state from chunk to chunk, which XLA runs as a ``lax.scan`` of tiny batched
matmuls, one launch each per chunk. Here that pass is one program per (batch, head): the
``(dk, dv)`` state stays in registers / shared memory for the whole sequence, each chunk is
three matmuls (``w S``, ``qd S + attn v'``, ``kd^T v'``), and nothing but the output leaves
the program (flash-linear-attention's ``chunk_fwd_h`` + ``chunk_fwd_o`` fused).

The backward pass (``custom_vjp``) is the Pallas reverse scan of
``edl.kernels.delta_rule_bwd`` where Triton compiles it (GPU programs) and with
``interpret=True`` (both kernels interpreted: the tests); elsewhere (CPU) it is XLA's
``jax.vjp`` of ``chunk_scan_xla``, the reference, recomputed from the kernel's inputs (an
interpreted kernel would be slower than the scan). TPU programs use
``edl.kernels.tpu.delta_rule`` (Mosaic) instead.

On GPU, Triton wants power-of-two dims of at least 16 in every matmul: ``dk`` and ``dv``
are zero-padded (zeros leave every product's real part unchanged) and the chunk must be a
power of two >= 16 (edl's is 64). Interpreted on CPU any size runs (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from edl.kernels._common import compiler_params, pad_axis, padded_head_dim
from edl.kernels.delta_rule_bwd import chunk_scan_bwd
from edl.platforms import platform_dependent

__all__ = ["XLA_SCAN_SCOPE", "chunk_scan_xla", "pallas_chunk_scan"]

XLA_SCAN_SCOPE = "edl_delta_rule_chunk_scan_xla"  # in lowered text with debug_info=True

Chunks = Float[Array, "batch heads chunks chunk dim"]
State = Float[Array, "batch heads dk dv"]


def chunk_scan_xla(qd, kd, u, w, attn, decay, state: State) -> tuple[Chunks, State]:
    """The state through the chunks as a ``lax.scan`` (the kernel's reference and its
    backward pass). Per chunk ``v' = u - w S``, ``o = qd S + attn v'``,
    ``S = decay * S + kd^T v'``; ``qd``, ``kd``, ``w`` ``(b, h, n, C, dk)``, ``u``
    ``(b, h, n, C, dv)``, ``attn`` ``(b, h, n, C, C)``, ``decay`` ``(b, h, n)``. Returns the
    output ``(b, h, n, C, dv)`` and the final state."""

    def step(s, xs):
        qd, kd, u, w, attn, decay = xs
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
        out = jnp.einsum("bhck,bhkv->bhcv", qd, s) + jnp.einsum("bhcd,bhdv->bhcv", attn, v_new)
        s = s * decay[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return s, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (qd, kd, u, w, attn, decay))
    # Named: lowered programs say where this scan runs (a kernel's program holds none).
    with jax.named_scope(XLA_SCAN_SCOPE):
        state, out = jax.lax.scan(step, state.astype(u.dtype), xs)
    return jnp.moveaxis(out, 0, 2), state


def _kernel(qd_ref, kd_ref, u_ref, w_ref, attn_ref, decay_ref, s0_ref, o_ref, s_ref, *, chunk):
    num_chunks = qd_ref.shape[0] // chunk

    def body(i, s):
        rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        qd, kd, w = qd_ref[rows, :], kd_ref[rows, :], w_ref[rows, :]
        u, attn = u_ref[rows, :], attn_ref[rows, :]
        # Every entry of a chunk's row holds its decay (a scalar load Triton cannot tile).
        decay = jnp.max(decay_ref[rows])
        v_new = u - jnp.dot(w, s)
        o_ref[rows, :] = (jnp.dot(qd, s) + jnp.dot(attn, v_new)).astype(o_ref.dtype)
        kv = jax.lax.dot_general(kd, v_new, (((0,), (0,)), ((), ())))
        return s * decay + kv

    s_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s0_ref[...]).astype(s_ref.dtype)


def _call(qd, kd, u, w, attn, decay, state, *, interpret: bool):
    b, h, n, c, dk = qd.shape
    dv = u.shape[-1]
    pk, pv = padded_head_dim(dk, interpret), padded_head_dim(dv, interpret)
    flat = lambda x, d: pad_axis(x.reshape(b * h, n * c, x.shape[-1]), 2, d)
    qd, kd, w = (flat(x, pk) for x in (qd, kd, w))
    u, attn = flat(u, pv), flat(attn, c)
    decay = jnp.broadcast_to(decay[..., None], (b, h, n, c)).reshape(b * h, n * c)
    state = pad_axis(pad_axis(state.reshape(b * h, dk, dv), 1, pk), 2, pv).astype(u.dtype)
    seq = lambda d: pl.BlockSpec((None, n * c, d), lambda i: (i, 0, 0))
    state_spec = pl.BlockSpec((None, pk, pv), lambda i: (i, 0, 0))
    out, final = pl.pallas_call(
        functools.partial(_kernel, chunk=c),
        grid=(b * h,),
        in_specs=[
            seq(pk),
            seq(pk),
            seq(pv),
            seq(pk),
            seq(c),
            pl.BlockSpec((None, n * c), lambda i: (i, 0)),
            state_spec,
        ],
        out_specs=[seq(pv), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b * h, n * c, pv), u.dtype),
            jax.ShapeDtypeStruct((b * h, pk, pv), u.dtype),
        ],
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="edl_delta_rule_chunk_scan",
    )(qd, kd, u, w, attn, decay, state)
    out = out[..., :dv].reshape(b, h, n, c, dv)
    return out, final[:, :dk, :dv].reshape(b, h, dk, dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _scan(qd, kd, u, w, attn, decay, state, interpret):
    args = (qd, kd, u, w, attn, decay, state)
    if interpret is not None:
        return _call(*args, interpret=interpret)
    # As ``by_interpret`` (which returns one array, this two): Triton on GPUs.
    compiled = functools.partial(_call, interpret=False)
    interpreted = functools.partial(_call, interpret=True)
    return platform_dependent(*args, cuda=compiled, rocm=compiled, default=interpreted)


def _scan_fwd(qd, kd, u, w, attn, decay, state, interpret):
    args = (qd, kd, u, w, attn, decay, state)
    return _scan(*args, interpret), args


def _xla_bwd(*args_and_cotangents):
    *args, d_out, d_final = args_and_cotangents
    _, pullback = jax.vjp(chunk_scan_xla, *args)
    return pullback((d_out, d_final))


def _kernel_bwd(*args_and_cotangents, interpret: bool):
    *args, d_out, d_final = args_and_cotangents
    return chunk_scan_bwd(tuple(args), (d_out, d_final), interpret=interpret)


def _scan_bwd(interpret, args, cotangents):
    # The Pallas backward (``edl.kernels.delta_rule_bwd``) where Triton compiles it, or
    # interpreted when asked (the tests); elsewhere XLA's vjp of the scan, the reference:
    # interpreting the kernel on CPU would be slower than the scan it replaces.
    operands = (*args, *cotangents)
    if interpret:
        return _kernel_bwd(*operands, interpret=True)
    compiled = functools.partial(_kernel_bwd, interpret=False)
    return platform_dependent(*operands, cuda=compiled, rocm=compiled, default=_xla_bwd)


_scan.defvjp(_scan_fwd, _scan_bwd)


def pallas_chunk_scan(
    qd, kd, u, w, attn, decay, state: State, *, interpret: bool | None = None
) -> tuple[Chunks, State]:
    """``chunk_scan_xla`` as one Pallas program per (batch, head); differentiable (a Pallas
    reverse scan on GPU). ``interpret``: ``None`` compiles both kernels through Triton in
    programs lowered for GPUs and elsewhere interprets the forward, the backward being
    XLA's vjp of the scan; ``True`` interprets the forward and the backward kernels."""
    if qd.shape[3] != attn.shape[-1]:
        raise ValueError(f"pallas_chunk_scan: attn {attn.shape} must be (b, h, n, C, C)")
    return _scan(qd, kd, u, w, attn, decay, state, interpret)
