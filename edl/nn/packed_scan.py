"""``packed_scan``: a differentiable ``lax.scan`` whose loops hold 16-bit floats as 16 bits.

Why: XLA:CPU computes bfloat16 / float16 in float32 (its float normalization) and counts
data movement among the operations it widens: a ``dynamic-slice`` of a bfloat16 weight
stack inside a loop is rewritten to slice a float32 copy of the whole stack (hoisted out of
the loop), and the ``dynamic-update-slice`` that stacks a saved activation into the scan's
residual buffer turns that buffer float32. A bfloat16 train step of a scanned layer stack
therefore held float32 copies of every layer's weights and of every saved activation: more
memory than the float32 step (``benchmarks/RESULTS.md``, "memory: a LoRA step's peak per
precision").

Integers are not widened. This scan moves every 16-bit float that crosses an iteration
(sliced inputs, saved residuals, stacked gradients) as ``uint16`` bits
(``lax.bitcast_convert_type``: the same bytes, no rounding) and turns them back into floats
inside the body, where XLA widens one layer's values at a time. It differentiates the body
itself (a ``jax.custom_vjp``): the forward scan runs ``jax.vjp`` of the body and stacks the
residuals it needs, packed; the backward scan runs the saved pullbacks in reverse. Residuals
that are the iteration's own slices of ``xs`` (a layer's weights) or values from outside the
body are not stacked: the backward pass slices / reads them again. A remat policy applied
to the body (``jax.checkpoint``) decides, as with ``lax.scan``, which values are residuals.

Numbers are those of ``lax.scan``: the same body, the same pullbacks, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jaxtyping import PyTree

__all__ = ["is_packed", "packed_scan"]

_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def is_packed(dtype: Any) -> bool:
    """Whether ``packed_scan`` moves arrays of ``dtype`` as integer bits (16-bit floats)."""
    return jnp.dtype(dtype) in _BITS


def has_packed(tree: PyTree) -> bool:
    """Whether any array leaf of ``tree`` is a 16-bit float."""
    return any(is_packed(jnp.result_type(x)) for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _pack(x: jax.Array) -> jax.Array:
    dtype = jnp.result_type(x)
    return jax.lax.bitcast_convert_type(x, _BITS[dtype]) if dtype in _BITS else x


def _unpack(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if jnp.dtype(dtype) in _BITS else x


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def packed_scan(
    body: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], carry: PyTree, xs: PyTree
) -> tuple[PyTree, PyTree]:
    """``jax.lax.scan(body, carry, xs)`` (forward only, no ``length`` / ``reverse``), with
    16-bit floats moved between iterations as ``uint16`` bits (the module docstring).

    Args:
        body: ``body(carry, x) -> (carry, y)``; it may close over traced values (they are
            passed to the scan explicitly).
        carry: the initial carry.
        xs: arrays with a shared leading axis, sliced per iteration.

    Returns:
        ``(carry, ys)`` as ``lax.scan`` returns them; differentiable (reverse mode).
    """
    xs_flat, xs_tree = jax.tree.flatten(xs)
    c_flat, c_tree = jax.tree.flatten(carry)
    if not xs_flat:
        raise ValueError("packed_scan: xs has no arrays (nothing gives the length)")
    x_avals = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs_flat]
    c_avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in c_flat]

    def flat_body(c_leaves, x_leaves):
        c, y = body(jax.tree.unflatten(c_tree, c_leaves), jax.tree.unflatten(xs_tree, x_leaves))
        c_out, c_out_tree = jax.tree.flatten(c)
        if c_out_tree != c_tree:
            raise ValueError(f"packed_scan: body changed the carry's structure to {c_out_tree}")
        return c_out, y

    # Closure conversion: the traced values the body closes over become explicit inputs.
    closed, (_, y_shape) = jax.make_jaxpr(flat_body, return_shape=True)(c_avals, x_avals)
    y_tree = jax.tree.structure(y_shape)
    consts = list(closed.consts)
    n_c = len(c_flat)

    def step(const_leaves, c_leaves, x_leaves):
        out = jax.core.eval_jaxpr(closed.jaxpr, const_leaves, *c_leaves, *x_leaves)
        return out[:n_c], out[n_c:]

    scan = _make_scan(step, n_consts=len(consts), n_carry=n_c)
    c_out, ys = scan(consts, c_flat, xs_flat)
    return jax.tree.unflatten(c_tree, c_out), jax.tree.unflatten(y_tree, ys)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _make_scan(step: Callable, *, n_consts: int, n_carry: int) -> Callable:
    """The ``custom_vjp`` scan of ``step(consts, carry, x) -> (carry, y)`` over flat lists:
    ``scan(consts, carry, xs) -> (carry, ys)``."""
    layout: dict[str, Any] = {}  # set while the forward body is traced, read by the backward

    def run(consts, carry, xs, one):
        """``lax.scan`` of ``one(c, x) -> (c, y, extra)`` with xs, ys and extras packed."""

        def packed_one(c, x_packed):
            x = [_unpack(p, a.dtype) for p, a in zip(x_packed, xs, strict=True)]
            c, y, extra = one(c, x)
            layout["ys"] = [_struct(v) for v in y]
            return c, ([_pack(v) for v in y], [_pack(v) for v in extra])

        c, (ys, extras) = jax.lax.scan(packed_one, tuple(carry), [_pack(x) for x in xs])
        ys = [_unpack(v, a.dtype) for v, a in zip(ys, layout["ys"], strict=True)]
        return list(c), ys, extras

    @jax.custom_vjp
    def scan(consts, carry, xs):
        def one(c, x):
            c, y = step(consts, list(c), x)
            return tuple(c), y, []

        c, ys, _ = run(consts, carry, xs, one)
        return c, ys

    def fwd(consts, carry, xs):
        perturbed = [p.perturbed for p in consts] + [_inexact(p.value) for p in carry]
        perturbed += [p.perturbed for p in xs]
        consts, carry, xs = ([p.value for p in group] for group in (consts, carry, xs))
        layout["diff"] = perturbed

        def one(c, x):
            (c_out, y), pullback = _linearize(step, [*consts, *c, *x], perturbed, n_consts, n_carry)
            return c_out, list(y), _split_residuals(pullback, consts, x, layout)

        c_out, ys, residuals = run(consts, carry, xs, one)
        layout["carry"] = [_struct(c) for c in c_out]
        return (c_out, ys), (consts, xs, residuals)

    def bwd(res, cotangents):
        consts, xs, residuals = res
        g_carry, g_ys = (
            [_instantiate(g, p) for g, p in zip(gs, ps, strict=True)]
            for gs, ps in zip(cotangents, (layout["carry"], layout["ys"]), strict=True)
        )
        return _backward(layout, consts, xs, residuals, g_carry, g_ys, n_consts, n_carry)

    scan.defvjp(fwd, bwd, symbolic_zeros=True)
    return scan


def _linearize(step: Callable, inputs: list, perturbed: list, n_consts: int, n_carry: int):
    """``jax.vjp`` of one iteration with respect to its ``perturbed`` inputs only (a frozen
    weight gets no cotangent computed): ``((carry, y), pullback)``."""

    def f(*diff_values):
        it = iter(diff_values)
        full = [next(it) if d else v for v, d in zip(inputs, perturbed, strict=True)]
        c_out, y = step(
            full[:n_consts], full[n_consts : n_consts + n_carry], full[n_consts + n_carry :]
        )
        return tuple(c_out), tuple(y)

    return jax.vjp(f, *[v for v, d in zip(inputs, perturbed, strict=True) if d])


def _split_residuals(pullback, consts: Sequence, x: Sequence, layout: dict) -> list:
    """The pullback's residual arrays that must be stacked; records where the others come
    from (a slice of ``xs``, a const) in ``layout`` for the backward scan. A residual that is
    an input unchanged is that very object (jax keeps the primal it was given), so identity
    finds a layer's weights, which are then sliced again rather than copied per iteration."""
    leaves, tree = jax.tree.flatten(pullback)
    where_x = {id(v): k for k, v in enumerate(x)}
    where_c = {id(v): k for k, v in enumerate(consts)}
    sources, stored = [], []
    for leaf in leaves:
        if id(leaf) in where_x:
            sources.append(("x", where_x[id(leaf)]))
        elif id(leaf) in where_c:
            sources.append(("const", where_c[id(leaf)]))
        else:
            sources.append(("stored", len(stored), jnp.result_type(leaf)))
            stored.append(leaf)
    layout["pullback"], layout["sources"] = tree, sources
    return stored


def _instantiate(g: Any, primal: jax.ShapeDtypeStruct) -> Any:
    if isinstance(g, SymbolicZero) or g is None:
        return _zeros_like_cotangent(primal)
    return g


def _zeros_like_cotangent(x: Any) -> Any:
    """The zero cotangent of ``x`` (``float0`` for integer arrays, as ``jax.vjp`` wants)."""
    if _inexact(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _backward(layout, consts, xs, residuals, g_carry, g_ys, n_consts: int, n_carry: int):
    """The reverse scan: each iteration's pullback, its ``xs`` cotangents stacked (packed),
    the consts' summed in the carry (in their own dtype, as ``lax.scan``'s transpose)."""
    diff = layout["diff"]
    diff_consts = [k for k in range(n_consts) if diff[k]]
    diff_carry = [k for k in range(n_carry) if diff[n_consts + k]]
    diff_xs = [k for k in range(len(xs)) if diff[n_consts + n_carry + k]]
    carry_structs = layout["carry"]

    def one(state, inp):
        g_c_diff, g_consts = state
        x_packed, stored, g_y_packed = inp
        x = [_unpack(p, a.dtype) for p, a in zip(x_packed, xs, strict=True)]
        g_y = [
            _unpack(g, a.dtype) if _inexact(a) else _zeros_like_cotangent(a)
            for g, a in zip(g_y_packed, layout["ys"], strict=True)
        ]
        g_c = [_zeros_like_cotangent(a) for a in carry_structs]
        for k, g in zip(diff_carry, g_c_diff, strict=True):
            g_c[k] = g
        leaves = []
        for source in layout["sources"]:
            if source[0] == "x":
                leaves.append(x[source[1]])
            elif source[0] == "const":
                leaves.append(consts[source[1]])
            else:
                leaves.append(_unpack(stored[source[1]], source[2]))
        pullback = jax.tree.unflatten(layout["pullback"], leaves)
        grads = iter(pullback((tuple(g_c), tuple(g_y))))
        g_const_step = [next(grads) for _ in diff_consts]
        g_c_diff = [next(grads) for _ in diff_carry]
        g_x = [next(grads) for _ in diff_xs]
        g_consts = [a + g.astype(a.dtype) for a, g in zip(g_consts, g_const_step, strict=True)]
        return (g_c_diff, g_consts), [_pack(g) for g in g_x]

    zeros = [jnp.zeros(jnp.shape(consts[k]), jnp.result_type(consts[k])) for k in diff_consts]
    g_ys_packed = [
        _pack(g) if _inexact(a) else jnp.zeros((len(g),), jnp.int8)
        for g, a in zip(g_ys, layout["ys"], strict=True)
    ]
    (g_init, g_consts), g_xs_packed = jax.lax.scan(
        one,
        ([g_carry[k] for k in diff_carry], zeros),
        ([_pack(x) for x in xs], residuals, g_ys_packed),
        reverse=True,
    )
    out_consts = [None] * n_consts
    for k, g in zip(diff_consts, g_consts, strict=True):
        out_consts[k] = g
    out_carry = [None] * n_carry
    for k, g in zip(diff_carry, g_init, strict=True):
        out_carry[k] = g
    out_xs = [None] * len(xs)
    for k, g in zip(diff_xs, g_xs_packed, strict=True):
        out_xs[k] = _unpack(g, jnp.result_type(xs[k]))
    return out_consts, out_carry, out_xs
