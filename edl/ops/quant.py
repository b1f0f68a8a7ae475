"""Weight-only quantization as array functions: block-wise absmax int8 and NF4.

A weight ``(*lead, out, in)`` is flattened per matrix in row-major order and cut into
blocks of ``block_size`` consecutive elements (the last one zero-padded), as bitsandbytes
does; each block stores one float scale, its absmax::

    int8: q = round(w / s) in [-127, 127] (int8),   s = absmax / 127,  w ~ q * s
    nf4:  q = nearest NF4 code of w / s (4 bits),    s = absmax,        w ~ NF4[q] * s

NF4 packs two codes per uint8, the first in the high nibble (bitsandbytes' order).
``block_size == in`` gives one scale per output channel. ``quantized_matmul`` is
``x @ dequantize_weight(...).T``: XLA fuses the dequantization into the matmul's operand, so
only the packed weight is resident between calls.
"""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Integer

from edl.ops.matmul import linear

__all__ = [
    "FORMATS",
    "NF4_CODE",
    "Format",
    "dequantize_weight",
    "quantize_weight",
    "quantized_matmul",
]

Format: TypeAlias = Literal["int8", "nf4"]
FORMATS: tuple[str, ...] = ("int8", "nf4")

NF4_CODE: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NormalFloat-4 values of QLoRA (Dettmers et al., 2023), as bitsandbytes stores them:
quantiles of N(0, 1) at ``linspace(0.9677, 0.5, 9)`` (8 positive) and ``linspace(0.9677,
0.5, 8)`` (7 negative, mirrored), plus an exact 0, divided by the largest."""

_INT8_MAX = 127
# Every byte's two NF4 values (high nibble first): decoding is one gather per byte.
_NF4_PAIRS = np.stack([np.repeat(NF4_CODE, 16), np.tile(NF4_CODE, 16)], axis=-1).astype(np.float32)


def num_blocks(shape: tuple[int, int], block_size: int) -> int:
    """Blocks of ``block_size`` covering one ``(out, in)`` matrix (the last one padded)."""
    return -(-math.prod(shape) // block_size)


def check_format(format: str, block_size: int) -> None:
    """Raise ``ValueError`` unless ``format`` is known and ``block_size`` fits it."""
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; choose from {FORMATS}")
    if block_size < 1 or (format == "nf4" and block_size % 2):
        raise ValueError(
            f"{format}: block_size must be a positive{' even' if format == 'nf4' else ''} "
            f"integer (two 4-bit codes per byte), got {block_size}"
        )


def _blocks(w: jnp.ndarray, block_size: int) -> jnp.ndarray:
    """``(*lead, out, in)`` -> ``(*lead, blocks, block_size)`` float32, zero-padded."""
    lead, n = w.shape[:-2], math.prod(w.shape[-2:])
    flat = w.reshape(*lead, n).astype(jnp.float32)
    pad = num_blocks(w.shape[-2:], block_size) * block_size - n
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    return flat.reshape(*lead, -1, block_size)


def quantize_weight(
    w: Float[Array, "*lead out in"],
    *,
    format: Format,
    block_size: int,
    scale_dtype: DTypeLike = jnp.float32,
) -> tuple[Integer[Array, "*lead blocks packed"], Float[Array, "*lead blocks"]]:
    """Block-wise absmax quantization of each ``(out, in)`` matrix of ``w``.

    Returns ``(qweight, scales)``: int8 codes ``(*lead, blocks, block_size)`` or packed NF4
    ``(*lead, blocks, block_size // 2)`` uint8, and ``scales`` ``(*lead, blocks)`` in
    ``scale_dtype``, with ``blocks = ceil(out * in / block_size)``. Codes are chosen with
    the stored (rounded) scale, and an all-zero block gets scale 0 and codes for 0.
    """
    check_format(format, block_size)
    blocks = _blocks(w, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = (absmax / _INT8_MAX if format == "int8" else absmax).astype(scale_dtype)
    safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    normed = blocks / safe.reshape(*safe.shape, 1)
    if format == "int8":
        q = jnp.clip(jnp.round(normed), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
        return q, scale
    code = jnp.asarray(NF4_CODE, jnp.float32)
    # Nearest code = the number of midpoints below the value (the code book is sorted).
    midpoints = (code[1:] + code[:-1]) / 2
    codes = jnp.zeros(normed.shape, jnp.uint8)
    for m in midpoints:
        codes = codes + (normed > m).astype(jnp.uint8)
    pairs = codes.reshape(*codes.shape[:-1], block_size // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1], scale


def _codes(qweight: jnp.ndarray, format: str) -> jnp.ndarray:
    """The float32 value of each code, ``(*lead, blocks, block_size)``."""
    if format == "int8":
        return qweight.astype(jnp.float32)
    pairs = jnp.take(jnp.asarray(_NF4_PAIRS), qweight.astype(jnp.int32), axis=0)
    return pairs.reshape(*qweight.shape[:-1], 2 * qweight.shape[-1])


def dequantize_weight(
    qweight: Integer[Array, "*lead blocks packed"],
    scales: Float[Array, "*lead blocks"],
    *,
    format: Format,
    shape: tuple[int, int],
    dtype: DTypeLike = jnp.float32,
) -> Float[Array, "*lead out in"]:
    """The ``(*lead, out, in)`` weight of ``quantize_weight``'s output (``shape = (out, in)``),
    computed in float32 and cast to ``dtype``."""
    block_size = qweight.shape[-1] * (2 if format == "nf4" else 1)
    check_format(format, block_size)
    blocks = _codes(qweight, format) * scales.astype(jnp.float32).reshape(*scales.shape, 1)
    lead = qweight.shape[:-2]
    flat = blocks.reshape(*lead, -1)[..., : math.prod(shape)]
    return flat.reshape(*lead, *shape).astype(dtype)


def quantized_matmul(
    x: Float[Array, "*batch in"],
    qweight: Integer[Array, "blocks packed"],
    scales: Float[Array, " blocks"],
    *,
    format: Format,
    shape: tuple[int, int],
    addend: Float[Array, "*batch out"] | None = None,
) -> Float[Array, "*batch out"]:
    """``x @ W.T`` for the quantized ``(out, in)`` weight ``W``, in ``x``'s dtype.

    The weight is dequantized inside the jitted computation (float32 codes times scales,
    cast to ``x.dtype``), so XLA fuses it into the matmul's operand; nothing dense outlives
    the call. ``addend`` (a LoRA update) is added to the product as ``edl.ops.linear`` adds
    it: all zeros, it changes no bit.
    """
    if x.shape[-1] != shape[1]:
        raise ValueError(f"quantized_matmul: input features {x.shape[-1]} != weight's {shape[1]}")
    w = dequantize_weight(qweight, scales, format=format, shape=shape, dtype=x.dtype)
    return linear(x, w, addend=addend)
