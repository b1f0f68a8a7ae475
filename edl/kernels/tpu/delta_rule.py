"""The chunk scan of the gated delta rule for TPU (Pallas/Mosaic): forward and backward.

Same contract as :func:`edl.kernels.delta_rule.chunk_scan_xla` (the reference) and the GPU
kernels of ``edl.kernels.delta_rule`` / ``edl.kernels.delta_rule_bwd``: per chunk
``v' = u - w S``, ``o = qd S + attn v'``, ``S' = decay S + kd^T v'``.

Design: grid ``(batch * heads, chunks)``, the chunk axis innermost and ``"arbitrary"``; each
step DMAs one chunk's ``(C, dk)`` / ``(C, dv)`` / ``(C, C)`` blocks into VMEM (Mosaic
pipelines the next chunk's while this one computes) and carries the ``(dk, dv)`` state in
float32 VMEM scratch from step to step. The chunks' decays are scalars in SMEM (scalar
prefetch: ``b h n`` floats, 256 KiB at 65536 (batch, head, chunk) triples; untried on
hardware past small shapes). The backward walks the chunks in reverse (its index maps read chunk
``n - 1 - j`` at step ``j``) carrying ``dS`` in scratch; it needs the state at each chunk's
start, which the forward kernel writes when asked (``with_states``): the ``custom_vjp``
recomputes them in the backward rather than keeping them from the forward, for the reason
``edl.kernels.delta_rule_bwd`` gives (a ``(b, h, n, dk, dv)`` residual per layer held
through the whole train step vs one extra forward pass without output).

Mosaic tiles arrays by ``(8, 128)``: ``dk`` and ``dv`` are zero-padded to multiples of 128
(zeros add nothing to any product; the padding is sliced off), the chunk must be a multiple
of 8 (edl's is 64; its ``(C, C)`` ``attn`` block spans the whole last axis) and each
chunk's decay gradient is written lane-broadcast into an ``(8, 128)`` tile. Transposed
operands are explicit 2-D transposes, as jax's TPU kernels write them. Interpreted
(``interpret=True`` or a ``pltpu.InterpretParams``, the tests) any chunk runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from edl.kernels._common import cdiv, pad_axis

__all__ = ["tpu_chunk_scan"]

Chunks = Float[Array, "batch heads chunks chunk dim"]
State = Float[Array, "batch heads dk dv"]
LANES, SUBLANES = 128, 8


def _dot(a, b):
    wide = jnp.float64 if jnp.float64 in (a.dtype, b.dtype) else jnp.float32
    return jnp.dot(a, b, preferred_element_type=wide)


def _forward_kernel(decay_ref, qd, kd, u, w, attn, s0, o, final, *rest, with_states):
    s_scr = rest[-1]
    i, j, n = pl.program_id(0), pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _start():
        s_scr[...] = s0[...].astype(s_scr.dtype)

    s = s_scr[...]
    if with_states:
        rest[0][...] = s.astype(rest[0].dtype)
    v_new = u[...] - _dot(w[...], s)
    o[...] = (_dot(qd[...], s) + _dot(attn[...], v_new)).astype(o.dtype)
    s = s * decay_ref[i * n + j] + _dot(kd[...].T, v_new)
    s_scr[...] = s

    @pl.when(j == n - 1)
    def _finish():
        final[...] = s.astype(final.dtype)


def _backward_kernel(decay_ref, *refs):
    qd, kd, u, w, attn, states, do, dfinal = refs[:8]
    dqd, dkd, du, dw, dattn, ddecay, ds0, ds_scr = refs[8:]
    i, j, n = pl.program_id(0), pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _start():
        ds_scr[...] = dfinal[...].astype(ds_scr.dtype)

    ds, s, d_o = ds_scr[...], states[...], do[...]
    v_new = u[...] - _dot(w[...], s)
    dv = _dot(attn[...].T, d_o) + _dot(kd[...], ds)
    du[...] = dv.astype(du.dtype)
    dqd[...] = _dot(d_o, s.T).astype(dqd.dtype)
    dattn[...] = _dot(d_o, v_new.T).astype(dattn.dtype)
    dkd[...] = _dot(v_new, ds.T).astype(dkd.dtype)
    dw[...] = (-_dot(dv, s.T)).astype(dw.dtype)
    # Lanes, then sublanes, kept 2-D (Mosaic's reductions), broadcast to the (8, 128) tile.
    total = jnp.sum(jnp.sum(s * ds, axis=1, keepdims=True), axis=0, keepdims=True)
    ddecay[...] = jnp.broadcast_to(total, ddecay.shape).astype(ddecay.dtype)
    ds = ds * decay_ref[i * n + (n - 1 - j)] + _dot(qd[...].T, d_o) - _dot(w[...].T, dv)
    ds_scr[...] = ds

    @pl.when(j == n - 1)
    def _finish():
        ds0[...] = ds.astype(ds0.dtype)


def _check_chunk(chunk: int, interpret) -> None:
    if not interpret and chunk % SUBLANES:
        raise ValueError(f"tpu_chunk_scan: the chunk ({chunk}) must be a multiple of {SUBLANES}")


def _layout(args):
    """The operands as ``(b h, n C, padded dim)`` slabs, decays flat ``(b h n,)``, state
    ``(b h, pk, pv)``; and the sizes."""
    qd, kd, u, w, attn, decay, _ = args
    b, h, n, c, dk = qd.shape
    dv, dt = u.shape[-1], u.dtype
    pk, pv = LANES * cdiv(dk, LANES), LANES * cdiv(dv, LANES)
    flat = lambda x, d: pad_axis(x.reshape(b * h, n * c, x.shape[-1]).astype(dt), 2, d)
    slabs = (flat(qd, pk), flat(kd, pk), flat(u, pv), flat(w, pk), flat(attn, c))
    square = lambda x: pad_axis(pad_axis(x.reshape(b * h, dk, dv), 1, pk), 2, pv).astype(dt)
    sizes = dict(b=b, h=h, n=n, c=c, dk=dk, dv=dv, pk=pk, pv=pv)
    return slabs, decay.reshape(b * h * n).astype(dt), square, sizes


def _call(kernel, name, decays, inputs, in_blocks, outputs, out_blocks, scratch, interpret):
    """A pallas_call over the grid ``(b h, n)``; blocks ``(shape, index_map(i, j))``."""
    spec = lambda shape, index: pl.BlockSpec(shape, lambda i, j, _: index(i, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(inputs[0].shape[0], decays.shape[0] // inputs[0].shape[0]),
        in_specs=[spec(*b) for b in in_blocks],
        out_specs=[spec(*b) for b in out_blocks],
        scratch_shapes=[pltpu.VMEM(scratch.shape, scratch.dtype)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=outputs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(decays, *inputs)


def _forward(args, *, with_states: bool, interpret):
    slabs, decays, square, z = _layout(args)
    _check_chunk(z["c"], interpret)
    bh, n, c, pk, pv, dt = slabs[0].shape[0], z["n"], z["c"], z["pk"], z["pv"], slabs[2].dtype
    chunk = lambda d: ((None, c, d), lambda i, j: (i, j, 0))
    whole = ((None, pk, pv), lambda i, j: (i, 0, 0))
    outputs = [jax.ShapeDtypeStruct((bh, n * c, pv), dt), jax.ShapeDtypeStruct((bh, pk, pv), dt)]
    out_blocks = [chunk(pv), whole]
    if with_states:
        outputs.append(jax.ShapeDtypeStruct((bh, n, pk, pv), dt))
        out_blocks.append(((None, None, pk, pv), lambda i, j: (i, j, 0, 0)))
    return _call(
        functools.partial(_forward_kernel, with_states=with_states),
        "edl_tpu_delta_rule_fwd" + ("_states" if with_states else ""),
        decays,
        (*slabs, square(args[6])),
        [chunk(pk), chunk(pk), chunk(pv), chunk(pk), chunk(c), whole],
        outputs,
        out_blocks,
        jax.ShapeDtypeStruct((pk, pv), jnp.float64 if dt == jnp.float64 else jnp.float32),
        interpret,
    ), z


def _unpad_forward(outs, z):
    b, h, n, c, dv, dk = z["b"], z["h"], z["n"], z["c"], z["dv"], z["dk"]
    out = outs[0][..., :dv].reshape(b, h, n, c, dv)
    return out, outs[1][:, :dk, :dv].reshape(b, h, dk, dv)


def _backward(args, cotangents, *, interpret):
    states = _forward(args, with_states=True, interpret=interpret)[0][2]
    slabs, decays, square, z = _layout(args)
    bh, n, c, pk, pv, dt = slabs[0].shape[0], z["n"], z["c"], z["pk"], z["pv"], slabs[2].dtype
    d_out = pad_axis(cotangents[0].reshape(bh, n * c, z["dv"]).astype(dt), 2, pv)
    back = lambda d: ((None, c, d), lambda i, j: (i, n - 1 - j, 0))
    whole = ((None, pk, pv), lambda i, j: (i, 0, 0))
    state_block = ((None, None, pk, pv), lambda i, j: (i, n - 1 - j, 0, 0))
    shapes = [(n * c, pk), (n * c, pk), (n * c, pv), (n * c, pk), (n * c, c)]
    outputs = [jax.ShapeDtypeStruct((bh, *s), dt) for s in shapes]
    outputs += [
        jax.ShapeDtypeStruct((bh, n * SUBLANES, LANES), dt),
        jax.ShapeDtypeStruct((bh, pk, pv), dt),
    ]
    tile = ((None, SUBLANES, LANES), lambda i, j: (i, n - 1 - j, 0))
    grads = _call(
        _backward_kernel,
        "edl_tpu_delta_rule_bwd",
        decays,
        (*slabs, states, d_out, square(cotangents[1])),
        [back(pk), back(pk), back(pv), back(pk), back(c), state_block, back(pv), whole],
        outputs,
        [back(pk), back(pk), back(pv), back(pk), back(c), tile, whole],
        jax.ShapeDtypeStruct((pk, pv), jnp.float64 if dt == jnp.float64 else jnp.float32),
        interpret,
    )
    return _unpad_backward(args, grads, z)


def _unpad_backward(args, grads, z):
    b, h, n, c, dk, dv = z["b"], z["h"], z["n"], z["c"], z["dk"], z["dv"]
    d_qd, d_kd, d_u, d_w, d_attn, d_decay, d_s0 = grads
    chunks = lambda x, d: x[..., :d].reshape(b, h, n, c, d)
    out = (
        chunks(d_qd, dk),
        chunks(d_kd, dk),
        chunks(d_u, dv),
        chunks(d_w, dk),
        chunks(d_attn, c),
        d_decay.reshape(b, h, n, SUBLANES, LANES)[..., 0, 0],
        d_s0[:, :dk, :dv].reshape(b, h, dk, dv),
    )
    return tuple(g.astype(a.dtype) for g, a in zip(out, args, strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _scan(qd, kd, u, w, attn, decay, state, interpret):
    outs, z = _forward((qd, kd, u, w, attn, decay, state), with_states=False, interpret=interpret)
    return _unpad_forward(outs, z)


def _scan_fwd(qd, kd, u, w, attn, decay, state, interpret):
    args = (qd, kd, u, w, attn, decay, state)
    return _scan(*args, interpret), args


def _scan_bwd(interpret, args, cotangents):
    return _backward(args, cotangents, interpret=interpret)


_scan.defvjp(_scan_fwd, _scan_bwd)


def tpu_chunk_scan(
    qd, kd, u, w, attn, decay, state: State, *, interpret: bool | pltpu.InterpretParams = False
) -> tuple[Chunks, State]:
    """``chunk_scan_xla`` as Mosaic kernels: output ``(b, h, n, C, dv)`` and final state
    ``(b, h, dk, dv)`` in ``u``'s dtype; differentiable (the backward is a Mosaic reverse
    scan). ``interpret``: False compiles for TPU; True or a ``pltpu.InterpretParams`` runs
    Pallas' interpreter."""
    if qd.shape[3] != attn.shape[-1]:
        raise ValueError(f"tpu_chunk_scan: attn {attn.shape} must be (b, h, n, C, C)")
    return _scan(qd, kd, u, w, attn, decay, state, interpret)
