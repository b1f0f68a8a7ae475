"""``linear``: ``x @ weight.T`` for a torch-layout ``(out, in)`` weight.

It takes an ``addend`` (a LoRA update), added to the product before anything the caller's
consumers could fuse with it, so that an all-zero update changes no bit of what they compute.

Lowered for CPU, two XLA:CPU arrangements of the same maths take over (``edl.ops.cpu`` says
why, ``benchmarks/RESULTS.md`` "linear: few-row GEMMs on CPU" measures them): at 2 to
``SMALL_ROWS`` rows, known statically, the product is computed weight-left
(``cpu.weight_left``); and the addend is added by ``cpu.add_unless_zero``, a conditional that
hands on the product itself when the addend is all zeros. Elsewhere both are the plain product
and sum.

Several projections of one input (q/k/v, gate/up) are separate ``linear`` calls. One product
over the concatenated weights was tried and dropped: inside a layer scan the concatenation
fused into the copy XLA:CPU makes of each layer's weights anyway (a few percent faster), but
over unstacked layers (``DecoderModel.unstacked``, how the serving engine decodes) it copied
every weight on every call and made a 4-row decode step 5x slower (``benchmarks/RESULTS.md``,
"serve: unstacked decoding without weight copies").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from edl.ops import cpu
from edl.platforms import platform_dependent

__all__ = ["SMALL_ROWS", "linear"]

SMALL_ROWS = 64
"""Up to this many rows (``prod(x.shape[:-1])``), ``linear`` on CPU uses ``cpu.weight_left``
(the crossover measured in ``benchmarks/RESULTS.md``, "linear: few-row GEMMs on CPU")."""


def _weight_right(x: jax.Array, weight: jax.Array, addend: jax.Array | None = None) -> jax.Array:
    """``x @ weight.T + addend``: the definition."""
    if addend is not None and math.prod(x.shape[:-1]) == 1:
        # One row: XLA computes the product without it as a matrix-vector product and adds a
        # bias in that rank-1 form; the sum takes the same form, or the consumers would see
        # an extra reshape (and compile differently).
        y = cpu.add_unless_zero(jnp.einsum("i,oi->o", x.reshape(-1), weight), addend.reshape(-1))
        return y.reshape(addend.shape)
    return cpu.add_unless_zero(jnp.einsum("...i,oi->...o", x, weight), addend)


def _few_rows(x: jax.Array) -> bool:
    """Whether ``x``'s row count is one ``cpu.weight_left`` computes faster on CPU."""
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
        return platform_dependent(x, weight, addend, cpu=cpu.weight_left, default=_weight_right)
    return _weight_right(x, weight, addend)
