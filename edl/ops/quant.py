"""Weight-only quantization as array functions: block-wise absmax formats, int8 and NF4
built in, more by one registry entry (``QUANT_FORMATS``).

A weight ``(*lead, out, in)`` is flattened per matrix in row-major order and cut into
blocks of ``block_size`` consecutive elements (the last one zero-padded), as bitsandbytes
does; each block stores one float scale, ``s = absmax / max_code``, and its values divided by
``s`` become codes (a :class:`QuantFormat`'s ``encode`` / ``decode``)::

    int8: q = round(w / s) in [-127, 127] (int8),   s = absmax / 127,  w ~ q * s
    nf4:  q = nearest NF4 code of w / s (4 bits),    s = absmax,        w ~ NF4[q] * s

NF4 packs two codes per uint8, the first in the high nibble (bitsandbytes' order).
``block_size == in`` gives one scale per output channel. ``quantized_matmul`` is
``x @ dequantize_weight(...).T``: XLA fuses the dequantization into the matmul's operand, so
only the packed weight is resident between calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Integer, Shaped

from edl._registry import Registry
from edl.ops.matmul import linear

__all__ = [
    "NF4_CODE",
    "QUANT_FORMATS",
    "QuantFormat",
    "dequantize_weight",
    "quantize_weight",
    "quantized_matmul",
]

NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 NormalFloat-4 values of QLoRA (Dettmers et al., 2023), as bitsandbytes stores them:
quantiles of N(0, 1) at ``linspace(0.9677, 0.5, 9)`` (8 positive) and ``linspace(0.9677,
0.5, 8)`` (7 negative, mirrored), plus an exact 0, divided by the largest."""

_INT8_MAX = 127
# Every byte's two NF4 values (high nibble first): decoding is one gather per byte.
_NF4_PAIRS = np.stack([np.repeat(NF4_CODE, 16), np.tile(NF4_CODE, 16)], axis=-1).astype(np.float32)

Codes = Shaped[Array, "*lead blocks packed"]
"""Stored codes, one byte per element (``int8``, ``uint8``, a float8, ...)."""


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A block-wise absmax quantization format: one entry of ``QUANT_FORMATS``.

    Attributes:
        name: what ``QuantConfig.format``, ``edl train --quantize`` and a checkpoint's
            ``state.json`` call it.
        encode: a block's values divided by its scale, float32 ``(*lead, blocks,
            block_size)`` within ``[-max_code, max_code]`` -> the stored codes ``(*lead,
            blocks, block_size // codes_per_byte)``, one byte per element.
        decode: stored codes -> the float32 value of each code ``(*lead, blocks,
            block_size)`` (the inverse of ``encode`` up to rounding).
        max_code: the largest code magnitude; the scale rule is ``scale = absmax /
            max_code`` per block (an all-zero block gets scale 0 and codes for 0).
        codes_per_byte: codes packed into one stored element; block sizes are multiples.
        default_block: the block size when none is given: elements, or ``"channel"`` (one
            block per output row, i.e. ``in`` elements).
    """

    name: str
    encode: Callable[[Float[Array, "*lead blocks size"]], Codes]
    decode: Callable[[Codes], Float[Array, "*lead blocks size"]]
    max_code: float
    codes_per_byte: int = 1
    default_block: int | Literal["channel"] = "channel"

    def __post_init__(self) -> None:
        who = f"QuantFormat {self.name!r}"
        if not (math.isfinite(self.max_code) and self.max_code > 0):
            raise ValueError(f"{who}: max_code must be finite and > 0, got {self.max_code}")
        if self.codes_per_byte < 1:
            raise ValueError(f"{who}: codes_per_byte must be >= 1, got {self.codes_per_byte}")
        if self.default_block != "channel":
            self.check_block_size(self.default_block)

    def check_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` unless ``block_size`` is a positive multiple of
        ``codes_per_byte``."""
        n = self.codes_per_byte
        if block_size < 1 or block_size % n:
            kind = {1: "integer", 2: "even integer"}.get(n, f"multiple of {n}")
            raise ValueError(
                f"{self.name}: block_size must be a positive {kind} ({n} "
                f"code{'s' * (n > 1)} per byte), got {block_size}"
            )


def _int8_encode(normed: Float[Array, "*lead blocks size"]) -> Integer[Array, "*lead blocks size"]:
    return jnp.clip(jnp.round(normed), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)


def _int8_decode(q: Integer[Array, "*lead blocks size"]) -> Float[Array, "*lead blocks size"]:
    return q.astype(jnp.float32)


def _nf4_encode(normed: Float[Array, "*lead blocks size"]) -> Integer[Array, "*lead blocks half"]:
    code = jnp.asarray(NF4_CODE, jnp.float32)
    # Nearest code = the number of midpoints below the value (the code book is sorted).
    midpoints = (code[1:] + code[:-1]) / 2
    codes = jnp.zeros(normed.shape, jnp.uint8)
    for m in midpoints:
        codes = codes + (normed > m).astype(jnp.uint8)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def _nf4_decode(q: Integer[Array, "*lead blocks half"]) -> Float[Array, "*lead blocks size"]:
    pairs = jnp.take(jnp.asarray(_NF4_PAIRS), q.astype(jnp.int32), axis=0)
    return pairs.reshape(*q.shape[:-1], 2 * q.shape[-1])


_INT8 = QuantFormat("int8", _int8_encode, _int8_decode, max_code=float(_INT8_MAX))
_NF4 = QuantFormat(  # QLoRA's blocks of 64
    "nf4", _nf4_encode, _nf4_decode, max_code=1.0, codes_per_byte=2, default_block=64
)
QUANT_FORMATS: Registry[QuantFormat] = Registry("quantization format", [_INT8, _NF4])
"""The quantization formats by name: int8 (absmax, per channel by default) and nf4 (QLoRA's
NormalFloat-4 in blocks of 64). ``QUANT_FORMATS.register(QuantFormat(...))`` adds one;
``QUANT_FORMATS.registered(...)`` for the length of a ``with`` block."""


def num_blocks(shape: tuple[int, int], block_size: int) -> int:
    """Blocks of ``block_size`` covering one ``(out, in)`` matrix (the last one padded)."""
    return -(-math.prod(shape) // block_size)


def check_format(format: str, block_size: int) -> QuantFormat:
    """The registered format ``format``; raises ``ValueError`` unless it is one and
    ``block_size`` fits it."""
    entry = QUANT_FORMATS.lookup(format, "quantization format")
    entry.check_block_size(block_size)
    return entry


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
    format: str,
    block_size: int,
    scale_dtype: DTypeLike = jnp.float32,
) -> tuple[Codes, Float[Array, "*lead blocks"]]:
    """Block-wise absmax quantization of each ``(out, in)`` matrix of ``w`` in ``format`` (a
    name in ``QUANT_FORMATS``).

    Returns ``(qweight, scales)``: the codes ``(*lead, blocks, block_size //
    codes_per_byte)`` (int8 codes, or NF4 codes packed two per uint8), and ``scales``
    ``(*lead, blocks)`` in ``scale_dtype``, with ``blocks = ceil(out * in / block_size)``.
    Codes are chosen with the stored (rounded) scale, and an all-zero block gets scale 0 and
    codes for 0.
    """
    fmt = check_format(format, block_size)
    blocks = _blocks(w, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = (absmax / fmt.max_code).astype(scale_dtype)
    safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    q = fmt.encode(blocks / safe.reshape(*safe.shape, 1))
    packed = (*blocks.shape[:-1], block_size // fmt.codes_per_byte)
    if q.shape != packed or jnp.dtype(q.dtype).itemsize != 1:
        raise ValueError(
            f"quantization format {format!r}: encode returned {q.dtype}{q.shape}, "
            f"expected one byte per element, {packed}"
        )
    return q, scale


def dequantize_weight(
    qweight: Codes,
    scales: Float[Array, "*lead blocks"],
    *,
    format: str,
    shape: tuple[int, int],
    dtype: DTypeLike = jnp.float32,
) -> Float[Array, "*lead out in"]:
    """The ``(*lead, out, in)`` weight of ``quantize_weight``'s output (``shape = (out, in)``),
    computed in float32 and cast to ``dtype``."""
    fmt = QUANT_FORMATS.lookup(format, "quantization format")
    fmt.check_block_size(qweight.shape[-1] * fmt.codes_per_byte)
    blocks = fmt.decode(qweight) * scales.astype(jnp.float32).reshape(*scales.shape, 1)
    lead = qweight.shape[:-2]
    flat = blocks.reshape(*lead, -1)[..., : math.prod(shape)]
    return flat.reshape(*lead, *shape).astype(dtype)


def quantized_matmul(
    x: Float[Array, "*batch in"],
    qweight: Shaped[Array, "blocks packed"],
    scales: Float[Array, " blocks"],
    *,
    format: str,
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
