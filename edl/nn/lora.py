"""``LoraLinear``: a linear layer plus a low-rank update, PEFT's LoRA layer as a pytree.

    y = base_layer(x) + scaling * lora_B(lora_A(dropout(x)))

Field names and shapes are PEFT's (``base_layer``, ``lora_A.weight (r, in)``,
``lora_B.weight (out, r)``), so the paths of a LoRA'd model read like PEFT's module names
and its adapters map to PEFT's file keys through the model's HF key table. The base layer
is a ``Linear`` or a ``QuantizedLinear`` (QLoRA). In a layer stack every array, the
adapters included, carries the leading layer axis.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.layers import Linear
from edl.nn.quantized import QuantizedLinear
from edl.nn.stack import map_stacked

__all__ = [
    "LoraLinear",
]


def leading_shape(layer: Linear | QuantizedLinear | LoraLinear) -> tuple[int, ...]:
    """The stacking axes of a (possibly stacked) linear layer: ``()`` for a single one,
    ``(num_layers,)`` in a layer stack."""
    if isinstance(layer, LoraLinear):
        return leading_shape(layer.base_layer)
    array = layer.qweight if isinstance(layer, QuantizedLinear) else layer.weight
    return tuple(array.shape[:-2])


def _features(layer: Linear | QuantizedLinear) -> tuple[int, int]:
    return layer.shape if isinstance(layer, QuantizedLinear) else tuple(layer.weight.shape[-2:])


def _dtype(layer: Linear | QuantizedLinear) -> jnp.dtype:
    return jnp.dtype(layer.dtype if isinstance(layer, QuantizedLinear) else layer.weight.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _uniform_fan_in(key: PRNGKeyArray, *, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``U(-1/sqrt(in), 1/sqrt(in))`` of ``shape = (..., in)``: PEFT's
    ``kaiming_uniform_(a=sqrt(5))`` for ``lora_A`` (one compiled program per shape)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoraLinear(eqx.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(dropout(x)))``.

    Attributes:
        base_layer: the frozen layer, ``Linear`` or ``QuantizedLinear``.
        lora_A: ``Linear`` with weight ``(rank, in)``, no bias.
        lora_B: ``Linear`` with weight ``(out, rank)``, no bias; zero at init, so a fresh
            adapter leaves the layer's output exactly as it was.
        scaling: ``alpha / rank`` (static).
        dropout: dropout rate on the adapter's input (static). It applies only while
            ``dropout_key`` is set (``edl.lora.with_dropout_key``); without a key the layer
            runs as in evaluation, like PEFT in ``eval()`` mode.
        dropout_key: ``None``, or a PRNG key (one per layer in a stack).
    """

    base_layer: Linear | QuantizedLinear
    lora_A: Linear
    lora_B: Linear
    scaling: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)
    dropout_key: PRNGKeyArray | None = None

    @classmethod
    def init(
        cls,
        base_layer: Linear | QuantizedLinear,
        *,
        rank: int,
        scaling: float | int,
        dropout: float | int = 0.0,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ) -> LoraLinear:
        """Adapters for ``base_layer`` (single or stacked: each matrix gets its own A and B).

        ``lora_A ~ U(-1/sqrt(in), 1/sqrt(in))`` as PEFT draws it, ``lora_B = 0``; ``dtype``
        defaults to the base weight's dtype.
        """
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        dtype = _dtype(base_layer) if dtype is None else jnp.dtype(dtype)
        lead = leading_shape(base_layer)
        out_features, in_features = _features(base_layer)
        a = _uniform_fan_in(key, shape=(*lead, rank, in_features), dtype=dtype)
        b = jnp.zeros((*lead, out_features, rank), dtype)
        pair = lambda a, b: (Linear(a, None), Linear(b, None))
        lora_a, lora_b = map_stacked(pair, len(lead))(a, b)  # Linear is typed per matrix
        return cls(base_layer, lora_a, lora_b, scaling=float(scaling), dropout=float(dropout))

    @property
    def rank(self) -> int:
        return self.lora_A.weight.shape[-2]

    @property
    def bias(self) -> Float[Array, "*lead out"] | None:
        return self.base_layer.bias

    @property
    def weight(self) -> Float[Array, "*lead out in"]:
        """The merged weight ``W + scaling * B @ A`` (computed in float32, returned in the
        base weight's dtype), for code that reads ``.weight`` of a linear layer."""
        base = self.base_layer.weight
        delta = jnp.einsum(
            "...or,...ri->...oi",
            self.lora_B.weight.astype(jnp.float32),
            self.lora_A.weight.astype(jnp.float32),
        )
        return (base.astype(jnp.float32) + self.scaling * delta).astype(base.dtype)

    def merge(self) -> Linear | QuantizedLinear:
        """The base layer with the update folded into its weight. A quantized base is
        dequantized, merged and quantized again in its own format (rounding, as PEFT does)."""
        base = self.base_layer
        if isinstance(base, QuantizedLinear):
            dense = eqx.tree_at(lambda m: m.weight, base.dequantize(), self.weight)
            return QuantizedLinear.from_linear(
                dense, format=base.format, block_size=base.block_size, scale_dtype=base.scales.dtype
            )
        return eqx.tree_at(lambda m: m.weight, base, self.weight)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        # The update joins the base product inside the matmul (``addend``), not after it: a
        # sum added after it is fused into the consumers (residual add + norm, RoPE), which
        # XLA then compiles differently, an ulp off even for an update of exact zeros.
        return self.base_layer(x, addend=self.update(x))

    def update(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        """The adapter's term ``scaling * lora_B(lora_A(dropout(x)))`` alone."""
        h = x
        if self.dropout > 0.0 and self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
        return self.lora_B(self.lora_A(h)) * self.scaling
