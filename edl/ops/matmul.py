"""``linear``: ``x @ weight.T`` for a torch-layout ``(out, in)`` weight, fast at few rows.

XLA:CPU's GEMM for ``x @ W.T`` costs far more than its arithmetic when ``x`` has only a few
rows (8 rows x a 256x688 weight: ~7x the time of one row), and the projections of a decode
step at batch 8 are exactly such products. Computing the same product as ``(W @ x.T).T``
(the weight as the left operand, the small result transposed back) avoids most of that:
``benchmarks/linear.py`` (results in ``benchmarks/RESULTS.md``) measures 0.5-0.8x the time at
2-32 rows, ~0.9x at 64, no gain at 1 row (a matrix-vector product either way), even at 128
and slower from 256. So the swapped form is used only when the row count is known
(statically) to be small, and only when lowering for CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["SMALL_ROWS", "linear"]

SMALL_ROWS = 64
"""Up to this many rows (``prod(x.shape[:-1])``), ``linear`` on CPU uses the swapped form."""


def _weight_left(x: Float[Array, "*batch in"], weight: Float[Array, "out in"]) -> jax.Array:
    # The barrier keeps XLA from canonicalising the dot back to ``x @ W.T`` (the layout the
    # slow path has): the product is materialised as (out, *batch), then transposed.
    y = jax.lax.optimization_barrier(jnp.einsum("oi,...i->o...", weight, x))
    return jnp.moveaxis(y, 0, -1)


def _weight_right(x: Float[Array, "*batch in"], weight: Float[Array, "out in"]) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, weight)


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
    if 1 < math.prod(x.shape[:-1]) <= SMALL_ROWS:
        # platform_dependent keeps only the branch of the platform being lowered for.
        return jax.lax.platform_dependent(x, weight, cpu=_weight_left, default=_weight_right)
    return _weight_right(x, weight)
