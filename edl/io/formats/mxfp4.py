"""MXFP4 checkpoints (``quantization_config.quant_method = "mxfp4"``, GPT-OSS's released
experts) dequantised at load, bit for bit as transformers 5's ``Mxfp4Config(dequantize=True)``
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``).

A quantised tensor ``X`` of the file is two tensors: ``X_blocks`` ``(experts, rows, groups,
16)`` uint8, each byte two FP4 (e2m1) codes, the low nibble first, and ``X_scales``
``(experts, rows, groups)`` uint8, one E8M0 exponent (bias 127) per block of 32 values.
Dequantised, row ``r`` of expert ``e`` is ``FP4[code] * 2 ** (scale - 127)`` over its
``groups * 32`` values, and ``X`` is ``(experts, groups * 32, rows)``: transformers transposes
the last two axes into the layout its bf16 GPT-OSS checkpoints store (``gate_up_proj``
``(experts, dim, 2 * inter)``, ``down_proj`` ``(experts, inter, dim)``).

``dequantized_source`` puts ``X`` in place of the pair in a ``TensorSource``, read expert by
expert into the loader's buffer in the buffer's dtype (the model's): host memory holds one
expert's float32 values beside the buffer, not the quantised layer in float. Saving writes
the dequantised weights (no re-quantising save) and ``config.json`` without the
``quantization_config``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Shaped

__all__ = [
    "FP4_VALUES",
    "checkpoint_dtype",
    "dequantize_mxfp4",
    "dequantized_source",
    "is_mxfp4",
]

# e2m1 by its 4-bit code (sign bit 3): transformers' FP4_VALUES.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK_BYTES = 16  # 32 FP4 values per scale
SCALE_BIAS = 127  # E8M0
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(hf_config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` dict declares an MXFP4-quantised checkpoint."""
    quant = hf_config.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def checkpoint_dtype(hf_config: Mapping[str, Any]) -> np.dtype:
    """The float dtype the checkpoint's weights are stored in (``config.json``'s ``dtype``,
    or ``torch_dtype``), which transformers dequantises to; bfloat16 when it names none."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    try:
        dtype = np.dtype(jnp.dtype(name))
    except TypeError as e:
        raise ValueError(f"config.json: dtype {name!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"config.json: dtype {name!r} is not a floating dtype")
    return dtype


def _check(name: str, blocks: tuple[int, ...], scales: tuple[int, ...], dtypes=None) -> None:
    """Raise naming the tensor when the pair is not MXFP4's ``(E, rows, groups, 16)`` uint8
    blocks with ``(E, rows, groups)`` uint8 scales."""
    if len(blocks) != 4 or blocks[-1] != BLOCK_BYTES:
        raise ValueError(
            f"{name}{BLOCKS}: MXFP4 blocks must be (experts, rows, groups, {BLOCK_BYTES}) "
            f"(32 FP4 values per block), found shape {blocks}"
        )
    if tuple(scales) != tuple(blocks[:-1]):
        raise ValueError(
            f"{name}{SCALES}: expected shape {tuple(blocks[:-1])} (one scale per block of "
            f"{name}{BLOCKS} {tuple(blocks)}), found {tuple(scales)}"
        )
    for suffix, dtype in zip((BLOCKS, SCALES), dtypes or (), strict=False):
        if np.dtype(dtype) != np.uint8:
            raise ValueError(f"{name}{suffix}: MXFP4 tensors are uint8, found {dtype}")


def dequantize_mxfp4(
    blocks: Shaped[np.ndarray, "E R G 16"], scales: Shaped[np.ndarray, "E R G"], dtype: Any
) -> Shaped[np.ndarray, "E G*32 R"]:
    """The float tensor of an MXFP4 pair, in ``dtype``, equal bit for bit to transformers'
    ``convert_moe_packed_tensors(blocks, scales, dtype=dtype)``."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check("mxfp4", blocks.shape, scales.shape, (blocks.dtype, scales.dtype))
    out = np.empty((blocks.shape[0], blocks.shape[2] * 2 * BLOCK_BYTES, blocks.shape[1]), dtype)
    for e in range(blocks.shape[0]):
        out[e] = _expert(blocks[e], scales[e], np.dtype(dtype))
    return out


def _expert(
    blocks: Shaped[np.ndarray, "R G 16"], scales: Shaped[np.ndarray, "R G"], dtype: np.dtype
) -> Shaped[np.ndarray, "G*32 R"]:
    # transformers: lut[code] in ``dtype`` (every FP4 value is exact in any float dtype), then
    # torch.ldexp, exact in the promoted dtype (float32 for 16-bit floats: 2 ** 128 scales
    # 0 to 0 and 6 to inf there), rounded once to ``dtype``.
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    wide = np.result_type(dtype, np.float32)
    values = FP4_VALUES.astype(wide)[codes].reshape(*scales.shape, 2 * BLOCK_BYTES)
    with np.errstate(over="ignore"):
        exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS
        values = np.ldexp(values, exponents).reshape(scales.shape[0], -1).astype(dtype)
    return values.T


@dataclasses.dataclass(frozen=True)
class _Pair:
    source: Any  # a TensorSource
    name: str

    def read_into(self, out: np.ndarray) -> None:
        blocks_shape = self.source.shape(self.name + BLOCKS)
        blocks = np.empty(blocks_shape, np.uint8)
        scales = np.empty(blocks_shape[:-1], np.uint8)
        self.source.read_into(self.name + BLOCKS, blocks)
        self.source.read_into(self.name + SCALES, scales)
        for e in range(blocks.shape[0]):  # one expert's float32 values at a time
            out[e] = _expert(blocks[e], scales[e], out.dtype)


# ``source`` is an edl.io.formats.plan.TensorSource, not imported: the io import chain stays
# short (tests/test_layers.py).
def dequantized_source(source: Any, dtype: Any = jnp.bfloat16) -> Any:
    """``source`` with each ``X_blocks`` / ``X_scales`` pair replaced by the dequantised
    ``X`` (stored dtype ``dtype``: the checkpoint's float dtype, which a load without a dtype
    keeps). Raises naming the tensor for a pair that lacks a half or has the wrong shapes or
    dtypes."""
    tensors = source.tensors
    names = {k.removesuffix(s) for k in tensors for s in (BLOCKS, SCALES) if k.endswith(s)}
    add = {}
    for name in sorted(names):
        for have, lack in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
            if name + lack not in tensors:
                raise ValueError(
                    f"{name}{have}: MXFP4 {have.strip('_')} without {name}{lack} in the checkpoint"
                )
        blocks, scales = (source.shape(name + s) for s in (BLOCKS, SCALES))
        _check(name, blocks, scales, (source.dtype(name + BLOCKS), source.dtype(name + SCALES)))
        if name in tensors:
            raise ValueError(f"{name}: the checkpoint holds it both plain and as MXFP4 blocks")
        e, rows, groups, _ = blocks
        shape = (e, groups * 2 * BLOCK_BYTES, rows)
        add[name] = (shape, dtype, _Pair(source, name).read_into)
    drop = {name + s for name in names for s in (BLOCKS, SCALES)}
    return source.replaced(drop, add)
