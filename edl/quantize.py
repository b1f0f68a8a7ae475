"""Weight-only quantization of a model's linear layers, as pure model -> model functions.

    qmodel = edl.quantize.quantize(model, QuantConfig("nf4"))       # block-wise NF4, 64
    logits = qmodel(ids).logits                                   # dequantized in the matmul
    edl.quantize.is_quantized(qmodel)                             # True
    model_again = edl.quantize.dequantize(qmodel)                 # dense Linear layers back

Every ``Linear`` whose path matches ``config.pattern`` (``re.search`` over paths such as
``"model.layers.self_attn.q_proj"``) becomes a ``QuantizedLinear`` holding integer codes and
float scales in a format of ``edl.ops.quant.QUANT_FORMATS`` (int8 and NF4 built in; one
``QuantFormat`` entry adds another). Layer stacks are quantized per layer
matrix. The result is an ordinary pytree: it jits, generates, checkpoints with
``save_state`` and takes LoRA adapters (QLoRA: ``edl.lora.apply_lora`` on it trains only
the adapters).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from edl.nn.layers import Linear
from edl.nn.lora import LoraLinear
from edl.nn.quantized import BlockSize, QuantizedLinear
from edl.ops.quant import QUANT_FORMATS
from edl.tree import find, tree_apply

__all__ = ["DEFAULT_PATTERN", "QuantConfig", "dequantize", "is_quantized", "quantize"]

DEFAULT_PATTERN = r"(q|k|v|o|gate|up|down)_proj$"
"""The attention and MLP projections of the Llama family (the LM head and the embeddings
stay in floating point, as in QLoRA)."""


def is_linear(x: Any) -> bool:
    """A linear layer of any kind: ``Linear``, ``QuantizedLinear`` or ``LoraLinear``."""
    return isinstance(x, Linear | QuantizedLinear | LoraLinear)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How to quantize.

    Attributes:
        format: a name in ``edl.ops.quant.QUANT_FORMATS``: ``"nf4"`` (4-bit NormalFloat, two
            codes per byte), ``"int8"`` (absmax), or a registered one.
        block_size: elements per scale; ``None`` is the format's ``default_block`` (nf4: 64,
            int8: ``"channel"``, one scale per output channel).
        pattern: regex searched in each linear layer's path.
        scale_dtype: dtype of the stored scales.
    """

    format: str = "nf4"
    block_size: BlockSize = None
    pattern: str = DEFAULT_PATTERN
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        QUANT_FORMATS.lookup(self.format, "QuantConfig.format")
        if not jnp.issubdtype(jnp.dtype(self.scale_dtype), jnp.floating):
            raise ValueError(f"QuantConfig.scale_dtype must be floating, got {self.scale_dtype}")


def quantize(model: PyTree, config: QuantConfig | None = None) -> PyTree:
    """``model`` with every ``Linear`` matching ``config.pattern`` quantized.

    Raises ``ValueError`` when the pattern matches no linear layer (the message lists them),
    or matches one that is already quantized or carries LoRA adapters (quantize first, then
    ``apply_lora``).
    """
    config = QuantConfig() if config is None else config
    layers = find(model, is_linear, config.pattern)
    if not layers:
        raise ValueError(
            f"quantize: pattern {config.pattern!r} matches none of the linear layers "
            f"{sorted(find(model, is_linear))}"
        )
    taken = {p: type(x).__name__ for p, x in layers.items() if not isinstance(x, Linear)}
    if taken:
        raise ValueError(
            f"quantize: {taken} are not plain Linear layers; quantize a model before "
            "edl.lora.apply_lora (QLoRA), and only once"
        )
    to_quantized = functools.partial(
        QuantizedLinear.from_linear,
        format=config.format,
        block_size=config.block_size,
        scale_dtype=config.scale_dtype,
    )
    return tree_apply(dict.fromkeys(layers, to_quantized), model, is_leaf=is_linear)


def _is_quantized_layer(x: Any) -> bool:
    return isinstance(x, QuantizedLinear)


def dequantize(model: PyTree) -> PyTree:
    """Every ``QuantizedLinear`` (LoRA bases included) back to a dense ``Linear`` in the
    dtype it was quantized from. Raises ``ValueError`` for a model without any."""
    if not is_quantized(model):
        raise ValueError("dequantize: the model has no QuantizedLinear layers")
    return jax.tree.map(
        lambda x: x.dequantize() if _is_quantized_layer(x) else x,
        model,
        is_leaf=_is_quantized_layer,
    )


def is_quantized(model: PyTree) -> bool:
    """Whether any layer of ``model`` is a ``QuantizedLinear``."""
    return bool(find(model, _is_quantized_layer))
