"""``QuantizedLinear``: a ``Linear`` whose weight is stored as codes + scales in one of
``edl.ops.quant.QUANT_FORMATS`` (int8, NF4, ...).

The packed codes and the float scales are ordinary array leaves, so a quantized model is
still a pytree that jits, splits, checkpoints and shards like any other; the format and
the logical ``(out, in)`` shape are static fields. In a layer stack the arrays carry the
leading layer axis like every other leaf.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from edl.nn.layers import Linear, add_bias
from edl.nn.stack import map_stacked
from edl.ops.quant import (
    QUANT_FORMATS,
    Codes,
    check_format,
    dequantize_weight,
    quantize_weight,
    quantized_matmul,
)

__all__ = [
    "BlockSize",
    "QuantizedLinear",
]

BlockSize = int | Literal["channel"] | None
"""Elements per scale: an int, ``"channel"`` (one scale per output channel, i.e. per row)
or ``None`` for the format's default (its ``QuantFormat.default_block``: nf4 64, as QLoRA;
int8 ``"channel"``)."""

# One compiled program per weight shape (XLA fuses the intermediates: a whole layer stack is
# quantized in one pass without float32 copies of it).
_quantize_weight = jax.jit(quantize_weight, static_argnames=("format", "block_size", "scale_dtype"))


def resolve_block_size(format: str, block_size: BlockSize, in_features: int) -> int:
    """The block size in elements for a weight with ``in_features`` columns."""
    default = QUANT_FORMATS.lookup(format, "quantization format").default_block
    size = default if block_size is None else block_size
    size = in_features if size == "channel" else size
    check_format(format, size)
    return size


class QuantizedLinear(eqx.Module):
    """``y = x @ dequantize_weight(qweight, scales).T + bias``: weight-only quantized ``Linear``.

    Attributes:
        qweight: the format's codes ``(blocks, block_size // codes_per_byte)`` (int8 codes,
            or NF4 codes packed two per uint8), over the row-major flattened ``(out, in)``
            weight (``blocks = ceil(out * in / block_size)``, the last block zero-padded).
        scales: one per block, ``(blocks,)``, float32 unless chosen otherwise (note that
            ``edl.to_dtype`` casts them like any floating leaf).
        bias: kept in floating point, or ``None``.
        format: a name in ``edl.ops.quant.QUANT_FORMATS`` (static).
        shape: the logical ``(out, in)`` of one weight matrix (static).
        dtype: the dtype of the weight before quantization, restored by ``dequantize``.

    In a layer stack every array has the leading layer axis (``(layers, blocks, ...)``).
    """

    qweight: Codes
    scales: Float[Array, "*lead blocks"]
    bias: Float[Array, "*lead out"] | None
    format: str = eqx.field(static=True)
    shape: tuple[int, int] = eqx.field(static=True)
    dtype: str = eqx.field(static=True)

    @classmethod
    def from_linear(
        cls,
        linear: Linear,
        *,
        format: str,
        block_size: BlockSize = None,
        scale_dtype: DTypeLike = jnp.float32,
    ) -> QuantizedLinear:
        """Quantize ``linear`` (a single or stacked ``Linear``: leading axes are kept)."""
        shape = tuple(linear.weight.shape[-2:])
        size = resolve_block_size(format, block_size, shape[1])
        q, s = _quantize_weight(
            linear.weight, format=format, block_size=size, scale_dtype=scale_dtype
        )
        dtype = jnp.dtype(linear.weight.dtype).name
        return cls(q, s, linear.bias, format=format, shape=shape, dtype=dtype)

    @property
    def block_size(self) -> int:
        """Elements per scale."""
        codes_per_byte = QUANT_FORMATS.lookup(self.format, "QuantizedLinear.format").codes_per_byte
        return self.qweight.shape[-1] * codes_per_byte

    @property
    def weight(self) -> Float[Array, "*lead out in"]:
        """The dequantized weight ``(*lead, out, in)``, for code that reads ``.weight`` of a
        linear layer (a causal LM's chunked loss reads its head's)."""
        return dequantize_weight(
            self.qweight, self.scales, format=self.format, shape=self.shape, dtype=self.dtype
        )

    def dequantize(self) -> Linear:
        """The dense ``Linear`` these codes stand for (any leading axes kept)."""
        dense = lambda q: Linear(q.weight, q.bias)
        return map_stacked(dense, self.qweight.ndim - 2)(self)

    def __call__(
        self, x: Float[Array, "*batch in"], *, addend: Float[Array, "*batch out"] | None = None
    ) -> Float[Array, "*batch out"]:
        """``x @ W.T (+ addend) + bias`` with ``W`` dequantized in the matmul; ``addend`` as in
        ``edl.nn.Linear``."""
        y = quantized_matmul(
            x, self.qweight, self.scales, format=self.format, shape=self.shape, addend=addend
        )
        return add_bias(y, self.bias)
