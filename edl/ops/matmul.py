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


def _weight_left(x: Float[Array, "*batch in"], weight: Float[Array, "out in"]) -> jax.Array:
    # The barrier keeps XLA from canonicalising the dot back to ``x @ W.T`` (the layout the
    # slow path has): the product is materialised as (out, *batch), then transposed.
    y = jax.lax.optimization_barrier(jnp.einsum("oi,...i->o...", weight, x))
    return jnp.moveaxis(y, 0, -1)


def _weight_right(x: Float[Array, "*batch in"], weight: Float[Array, "out in"]) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, weight)


def _few_rows(x: jax.Array) -> bool:
    return 1 < math.prod(x.shape[:-1]) <= SMALL_ROWS


def linear(
    x: Float[Array, "*batch in"], weight: Float[Array, "out in"]
) -> Float[Array, "*batch out"]:
    """``x @ weight.T`` (torch's ``F.linear`` without bias), computed in ``x.dtype``.

    Args:
        x: activations ``(*batch, in)``.
        weight: ``(out, in)``, cast to ``x.dtype``.

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
    if _few_rows(x):
        # platform_dependent keeps only the branch of the platform being lowered for.
        return jax.lax.platform_dependent(x, weight, cpu=_weight_left, default=_weight_right)
    return _weight_right(x, weight)


def linear_many(
    x: Float[Array, "*batch in"], weights: Sequence[Float[Array, "_ in"]]
) -> tuple[Float[Array, "*batch _"], ...]:
    """``linear(x, w)`` for each ``w`` in ``weights`` (one input, several projections).

    Args:
        x: activations ``(*batch, in)``.
        weights: ``(out_i, in)`` each, cast to ``x.dtype``.

    Returns:
        ``(*batch, out_i)`` per weight. With few rows on CPU (the module docstring) they are
        slices of one product with the concatenated weights; otherwise separate ``linear``
        calls. Equal to separate calls up to summation order.
    """
    if not weights:
        raise ValueError("linear_many: no weights")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"linear_many: weight {i} is {w.shape}; want (out, {x.shape[-1]}) for input "
                f"{x.shape}"
            )
    if len(weights) == 1 or not _few_rows(x):
        return tuple(linear(x, w) for w in weights)
    weights = tuple(w.astype(x.dtype) for w in weights)

    def fused(x, *weights):
        y = _weight_left(x, jnp.concatenate(weights, axis=0))
        ends = itertools.accumulate(w.shape[0] for w in weights)
        return tuple(jnp.split(y, list(ends)[:-1], axis=-1))

    def separate(x, *weights):
        return tuple(_weight_right(x, w) for w in weights)

    return jax.lax.platform_dependent(x, *weights, cpu=fused, default=separate)
