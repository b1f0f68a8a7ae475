"""``linear``: ``x @ weight.T`` for a torch-layout ``(out, in)`` weight, fast at few rows.

XLA:CPU's GEMM for ``x @ W.T`` costs far more than its arithmetic when ``x`` has only a few
rows (8 rows x a 256x688 weight: ~7x the time of one row), and the projections of a decode
step at batch 8 are exactly such products. Computing the same product as ``(W @ x.T).T``
(the weight as the left operand, the small result transposed back) avoids most of that:
``benchmarks/linear.py`` (results in ``benchmarks/RESULTS.md``) measures 0.5-0.8x the time at
2-32 rows, ~0.9x at 64, no gain at 1 row (a matrix-vector product either way), even at 128
and slower from 256. So the swapped form is used only when the row count is known
(statically) to be small, and only when lowering for CPU.

``linear_many`` applies several weights to one input (q/k/v, gate/up). In that same regime it
runs one swapped GEMM over the weights concatenated along ``out``: fewer, wider products
(measured 5-7% of a batch-8 decode step). Inside a layer scan XLA:CPU copies each layer's
weights out of the stack anyway, and the concatenation fuses into that copy.

Both take an ``addend`` (a LoRA update), added to the raw product before anything the
caller's consumers could fuse with it. XLA:CPU compiles a fused computation differently
when one more term is fused into it (the summation order of a reduction such as an RMS
norm, or which multiply-add becomes an FMA, changes), so even an all-zero update added
*after* the product moved the consumers' results by an ulp. On CPU the sum is therefore a
conditional (a fusion boundary that XLA:CPU keeps, unlike ``optimization_barrier``) that
hands on the product itself when the addend is all zeros: the consumers then compile and
compute exactly as without an addend, so a zero LoRA update changes no bit. Elsewhere the
addend is a plain sum.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["SMALL_ROWS", "linear", "linear_many"]

SMALL_ROWS = 64
"""Up to this many rows (``prod(x.shape[:-1])``), ``linear`` on CPU uses the swapped form."""


@jax.custom_jvp
def _add_skipping_zeros(y: jax.Array, addend: jax.Array) -> jax.Array:
    # A conditional is a fusion boundary XLA:CPU keeps (optimization_barrier is gone before
    # fusion there): an all-zero addend hands on ``y`` itself, so y's consumers compile
    # exactly as they do for the product alone.
    return jax.lax.cond(jnp.any(addend != 0), jnp.add, lambda y, _: y, y, addend)


@_add_skipping_zeros.defjvp
def _add_skipping_zeros_jvp(primals, tangents):
    # Derivatives are those of ``y + addend`` either way: a zero LoRA update (B = 0) still
    # passes its gradient on to B.
    (y, addend), (dy, daddend) = primals, tangents
    return _add_skipping_zeros(y, addend), dy + daddend


def _add(y: jax.Array, addend: jax.Array | None) -> jax.Array:
    """``y + addend`` (``y`` when None); on CPU ``y`` itself where the addend is all zeros."""
    if addend is None:
        return y
    return jax.lax.platform_dependent(y, addend, cpu=_add_skipping_zeros, default=jnp.add)


def _weight_left(x: jax.Array, weight: jax.Array, addend: jax.Array | None = None) -> jax.Array:
    # The barrier keeps XLA from canonicalising the dot back to ``x @ W.T`` (the layout the
    # slow path has): the product is materialised as (out, *batch), then transposed.
    y = jax.lax.optimization_barrier(jnp.einsum("oi,...i->o...", weight, x))
    y = _add(y, None if addend is None else jnp.moveaxis(addend, -1, 0))
    return jnp.moveaxis(y, 0, -1)


def _weight_right(x: jax.Array, weight: jax.Array, addend: jax.Array | None = None) -> jax.Array:
    if addend is not None and math.prod(x.shape[:-1]) == 1:
        # One row: XLA computes the product without it as a matrix-vector product and adds a
        # bias in that rank-1 form; the sum takes the same form, or the consumers would see
        # an extra reshape (and compile differently).
        y = _add(jnp.einsum("i,oi->o", x.reshape(-1), weight), addend.reshape(-1))
        return y.reshape(addend.shape)
    return _add(jnp.einsum("...i,oi->...o", x, weight), addend)


def _few_rows(x: jax.Array) -> bool:
    return 1 < math.prod(x.shape[:-1]) <= SMALL_ROWS


def _check_addend(what: str, addend: jax.Array, x: jax.Array, out: int) -> jax.Array:
    want = (*x.shape[:-1], out)
    if tuple(addend.shape) != want:
        raise ValueError(f"{what}: addend {tuple(addend.shape)} != the product's shape {want}")
    return addend.astype(x.dtype)


def linear(
    x: Float[Array, "*batch in"],
    weight: Float[Array, "out in"],
    *,
    addend: Float[Array, "*batch out"] | None = None,
) -> Float[Array, "*batch out"]:
    """``x @ weight.T`` (torch's ``F.linear`` without bias), computed in ``x.dtype``.

    Args:
        x: activations ``(*batch, in)``.
        weight: ``(out, in)``, cast to ``x.dtype``.
        addend: optional ``(*batch, out)`` term (a LoRA update) added to the product before
            anything else sees it (the module docstring): all zeros, it leaves the result
            bit-identical to the product alone. Cast to ``x.dtype``.

    Returns:
        ``(*batch, out)``. Both ways of computing it are the same sum of products; they may
        differ in the last bits (summation order), never more.
    """
    if weight.ndim != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"linear: input features {x.shape[-1]} != weight's {weight.shape[-1]} "
            f"(input {x.shape}, weight {weight.shape}; want a weight (out, in))"
        )
    weight = weight.astype(x.dtype)
    if addend is not None:
        addend = _check_addend("linear", addend, x, weight.shape[0])
    if _few_rows(x):
        # platform_dependent keeps only the branch of the platform being lowered for.
        return jax.lax.platform_dependent(
            x, weight, addend, cpu=_weight_left, default=_weight_right
        )
    return _weight_right(x, weight, addend)


def linear_many(
    x: Float[Array, "*batch in"],
    weights: Sequence[Float[Array, "_ in"]],
    *,
    addends: Sequence[Float[Array, "*batch _"] | None] | None = None,
) -> tuple[Float[Array, "*batch _"], ...]:
    """``linear(x, w, addend=a)`` for each ``w`` in ``weights`` (one input, several
    projections).

    Args:
        x: activations ``(*batch, in)``.
        weights: ``(out_i, in)`` each, cast to ``x.dtype``.
        addends: ``None``, or per weight a ``(*batch, out_i)`` array or ``None`` (LoRA
            updates), each added to its product as ``linear`` adds its ``addend``.

    Returns:
        ``(*batch, out_i)`` per weight. With few rows on CPU (the module docstring) they are
        slices of one product with the concatenated weights (the addends, zeros where there
        is none, are added to that product); otherwise separate ``linear`` calls. Equal to
        separate calls up to summation order.
    """
    if not weights:
        raise ValueError("linear_many: no weights")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"linear_many: weight {i} is {w.shape}; want (out, {x.shape[-1]}) for input "
                f"{x.shape}"
            )
    addends = [None] * len(weights) if addends is None else list(addends)
    if len(addends) != len(weights):
        raise ValueError(f"linear_many: {len(addends)} addends for {len(weights)} weights")
    addends = [
        None if a is None else _check_addend(f"linear_many: addend {i}", a, x, w.shape[0])
        for i, (w, a) in enumerate(zip(weights, addends, strict=True))
    ]
    if len(weights) == 1 or not _few_rows(x):
        return tuple(linear(x, w, addend=a) for w, a in zip(weights, addends, strict=True))
    weights = tuple(w.astype(x.dtype) for w in weights)

    def fused(x, weights, addends):
        addend = None
        if any(a is not None for a in addends):
            addend = jnp.concatenate(
                [jnp.zeros((*x.shape[:-1], w.shape[0]), x.dtype) if a is None else a
                 for w, a in zip(weights, addends, strict=True)],
                axis=-1,
            )  # fmt: skip
        y = _weight_left(x, jnp.concatenate(weights, axis=0), addend)
        ends = itertools.accumulate(w.shape[0] for w in weights)
        return tuple(jnp.split(y, list(ends)[:-1], axis=-1))

    def separate(x, weights, addends):
        return tuple(_weight_right(x, w, a) for w, a in zip(weights, addends, strict=True))

    return jax.lax.platform_dependent(x, weights, addends, cpu=fused, default=separate)
