"""The backward pass of the Pallas chunk scan (``edl.kernels.delta_rule``) in Pallas (Triton).

Per chunk the forward is ``v' = u - w S``, ``o = qd S + attn v'``, ``S' = decay S + kd^T v'``
with ``S`` the state at the chunk's start. Given the output's cotangent ``do`` and, carried
backwards from the final state's cotangent, ``dS'``::

    dv'   = attn^T do + kd dS'            du = dv'
    dqd   = do S^T       dattn = do v'^T       dkd = v' dS'^T       dw = -dv' S^T
    ddecay = sum(S * dS')
    dS    = decay dS' + qd^T do - w^T dv'

Two programs per (batch, head), as flash-linear-attention's ``chunk_fwd_h`` +
``chunk_bwd_dh`` / ``chunk_bwd_dqkwg`` fused: ``_states_kernel`` recomputes the state at
every chunk's start (the forward's ``w S`` and ``kd^T v'``, no output), into a
``(b, h, n, dk, dv)`` buffer; ``_backward_kernel`` walks the chunks in reverse carrying
``dS`` in registers and writes every gradient. The states are recomputed rather than saved
by the forward kernel as a residual: saved, ``n dk dv`` floats per (batch, head) would stay
alive from each layer's forward to its backward (64 MiB a layer for 16 heads of 128 x 128
at 4096 tokens, times the layers a train step holds); recomputed, the buffer lives only
inside one layer's backward and costs two of the forward's three matmuls per chunk (about
a third of the backward's matmul work). The forward kernel stays output-only.

Triton wants power-of-two dims >= 16 in every matmul: ``dk`` / ``dv`` are zero-padded
(zeros add nothing to any product; the padded gradient columns are sliced off) and the
chunk must be a power of two >= 16 (edl's is 64). Interpreted (``interpret=True``, the
tests) any size runs. With ``S`` and ``dS`` both live the kernel runs 8 warps (two
``128 x 128`` float32 tiles in registers; 4 warps would spill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from edl.kernels._common import compiler_params, pad_axis, padded_head_dim

__all__ = ["chunk_scan_bwd"]

Chunks = Float[Array, "batch heads chunks chunk dim"]
State = Float[Array, "batch heads dk dv"]

_NN = (((1,), (0,)), ((), ()))  # a b
_TN = (((0,), (0,)), ((), ()))  # a^T b
_NT = (((1,), (1,)), ((), ()))  # a b^T


def _dot(a, b, dims=_NN):
    # float32 accumulation at least (float64 stays float64: the interpreted gradient checks).
    wide = jnp.float64 if jnp.float64 in (a.dtype, b.dtype) else jnp.float32
    return jax.lax.dot_general(a, b, dims, preferred_element_type=wide)


def _states_kernel(kd_ref, u_ref, w_ref, decay_ref, s0_ref, states_ref, *, chunk, dk):
    """The state at each chunk's start into rows ``[i dk, (i + 1) dk)`` of ``states_ref``."""
    num_chunks = kd_ref.shape[0] // chunk

    def body(i, s):
        rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        states_ref[pl.ds(pl.multiple_of(i * dk, dk), dk), :] = s.astype(states_ref.dtype)
        v_new = u_ref[rows, :] - _dot(w_ref[rows, :], s)
        # Every entry of a chunk's row holds its decay (a scalar load Triton cannot tile).
        return s * jnp.max(decay_ref[rows]) + _dot(kd_ref[rows, :], v_new, _TN)

    jax.lax.fori_loop(0, num_chunks, body, s0_ref[...].astype(u_ref.dtype))


def _backward_kernel(*refs, chunk, dk):
    (qd_ref, kd_ref, u_ref, w_ref, attn_ref, decay_ref, states_ref, do_ref, dfinal_ref) = refs[:9]
    dqd_ref, dkd_ref, du_ref, dw_ref, dattn_ref, ddecay_ref, ds0_ref = refs[9:]
    num_chunks = qd_ref.shape[0] // chunk

    def body(j, ds):
        i = num_chunks - 1 - j
        rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        s = states_ref[pl.ds(pl.multiple_of(i * dk, dk), dk), :]
        qd, kd, w, do = qd_ref[rows, :], kd_ref[rows, :], w_ref[rows, :], do_ref[rows, :]
        v_new = u_ref[rows, :] - _dot(w, s)
        dv = _dot(attn_ref[rows, :], do, _TN) + _dot(kd, ds)
        du_ref[rows, :] = dv.astype(du_ref.dtype)
        dqd_ref[rows, :] = _dot(do, s, _NT).astype(dqd_ref.dtype)
        dattn_ref[rows, :] = _dot(do, v_new, _NT).astype(dattn_ref.dtype)
        dkd_ref[rows, :] = _dot(v_new, ds, _NT).astype(dkd_ref.dtype)
        dw_ref[rows, :] = (-_dot(dv, s, _NT)).astype(dw_ref.dtype)
        # A chunk's decay gradient, written to each of its row's entries (sliced outside).
        ddecay = jnp.sum(s * ds)
        ddecay_ref[rows] = jnp.full((chunk,), ddecay, ddecay_ref.dtype)
        decay = jnp.max(decay_ref[rows])
        return ds * decay + _dot(qd, do, _TN) - _dot(w, dv, _TN)

    ds = jax.lax.fori_loop(0, num_chunks, body, dfinal_ref[...].astype(u_ref.dtype))
    ds0_ref[...] = ds.astype(ds0_ref.dtype)


def _name(suffix: str) -> str:
    return f"edl_delta_rule_chunk_scan_{suffix}"


def _pallas(kernel, name, inputs, in_dims, outputs, out_dims, *, grid, interpret, warps):
    """One program per (batch, head): every operand a whole ``(rows, dim)`` slab; ``in_dims``
    / ``out_dims`` the slabs' shapes (``(rows,)`` for the decays)."""
    spec = lambda dims: pl.BlockSpec((None, *dims), lambda i: (i,) + (0,) * len(dims))
    return pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[spec(d) for d in in_dims],
        out_specs=[spec(d) for d in out_dims],
        out_shape=outputs,
        compiler_params=compiler_params(num_warps=warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*inputs)


def chunk_scan_bwd(
    args: tuple, cotangents: tuple[Chunks, State], *, interpret: bool
) -> tuple[jax.Array, ...]:
    """Gradients of ``chunk_scan_xla(*args)`` (``args``: qd, kd, u, w, attn, decay, state)
    for ``cotangents`` (of the output ``(b, h, n, C, dv)`` and of the final state), as the
    ``custom_vjp`` of ``edl.kernels.delta_rule.pallas_chunk_scan`` returns them."""
    qd, kd, u, w, attn, decay, state = args
    d_out, d_final = cotangents
    b, h, n, c, dk = qd.shape
    dv = u.shape[-1]
    dt = u.dtype
    pk, pv = padded_head_dim(dk, interpret), padded_head_dim(dv, interpret)
    flat = lambda x, d: pad_axis(x.reshape(b * h, n * c, x.shape[-1]).astype(dt), 2, d)
    square = lambda x: pad_axis(pad_axis(x.reshape(b * h, dk, dv), 1, pk), 2, pv).astype(dt)
    qd_, kd_, w_ = (flat(x, pk) for x in (qd, kd, w))
    u_, do_, attn_ = flat(u, pv), flat(d_out, pv), flat(attn, c)
    decay_ = jnp.broadcast_to(decay[..., None], (b, h, n, c)).reshape(b * h, n * c).astype(dt)
    rows = n * c
    (states,) = _pallas(
        functools.partial(_states_kernel, chunk=c, dk=pk),
        _name("states"),
        (kd_, u_, w_, decay_, square(state)),
        [(rows, pk), (rows, pv), (rows, pk), (rows,), (pk, pv)],
        [jax.ShapeDtypeStruct((b * h, n * pk, pv), dt)],
        [(n * pk, pv)],
        grid=b * h,
        interpret=interpret,
        warps=4,
    )
    in_dims = [(rows, pk), (rows, pk), (rows, pv), (rows, pk), (rows, c), (rows,)]
    in_dims += [(n * pk, pv), (rows, pv), (pk, pv)]  # states, d_out, d_final
    out_dims = [(rows, pk), (rows, pk), (rows, pv), (rows, pk), (rows, c), (rows,), (pk, pv)]
    grads = _pallas(
        functools.partial(_backward_kernel, chunk=c, dk=pk),
        _name("bwd"),
        (qd_, kd_, u_, w_, attn_, decay_, states, do_, square(d_final)),
        in_dims,
        [jax.ShapeDtypeStruct((b * h, *d), dt) for d in out_dims],
        out_dims,
        grid=b * h,
        interpret=interpret,
        warps=8,
    )
    d_qd, d_kd, d_u, d_w, d_attn, d_decay, d_s0 = grads
    chunks = lambda x, d: x[..., :d].reshape(b, h, n, c, d)
    return (
        chunks(d_qd, dk).astype(qd.dtype),
        chunks(d_kd, dk).astype(kd.dtype),
        chunks(d_u, dv).astype(u.dtype),
        chunks(d_w, dk).astype(w.dtype),
        chunks(d_attn, c).astype(attn.dtype),
        d_decay.reshape(b, h, n, c)[..., 0].astype(decay.dtype),
        d_s0[:, :dk, :dv].reshape(b, h, dk, dv).astype(state.dtype),
    )
