"""``project``: several projections of one input (q/k/v, gate/up) as one GEMM where it pays."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
from jaxtyping import Array, Float

from edl.nn.layers import Linear, add_bias
from edl.nn.lora import LoraLinear
from edl.ops.matmul import linear_many

__all__ = ["project"]


def _dense_part(layer: eqx.Module) -> tuple[Linear, Callable | None] | None:
    """A layer's plain ``Linear`` and what is added to its product (a LoRA update), or None
    when it has no plain dense weight (quantized, or a layer type edl does not know)."""
    if type(layer) is Linear:
        return layer, None
    if isinstance(layer, LoraLinear) and type(layer.base_layer) is Linear:
        return layer.base_layer, layer.update
    return None


def project(x: Float[Array, "*batch in"], *layers: eqx.Module) -> tuple[jax.Array, ...]:
    """``tuple(layer(x) for layer in layers)``, the base products through ``linear_many`` (one
    GEMM at few rows on CPU) when every layer has a plain dense weight. LoRA layers count as
    their base ``Linear`` plus their update, added to the product (``linear_many``'s
    ``addends``), so adapters that are zero leave the outputs bit-identical to the unwrapped
    model's; any other layer (quantized) makes every layer run on its own."""
    parts = [_dense_part(layer) for layer in layers]
    if any(part is None for part in parts):
        return tuple(layer(x) for layer in layers)
    addends = [None if update is None else update(x) for _, update in parts]
    ys = linear_many(x, [base.weight for base, _ in parts], addends=addends)
    return tuple(add_bias(y, base.bias) for y, (base, _) in zip(ys, parts, strict=True))
