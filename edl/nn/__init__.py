"""Equinox layers (HF weight layouts), built with ``Module.init(..., key=...)``.

The names below are the layers a model is built of and the layer stacks; the vision towers'
layers are in ``edl.nn.encoder``, MoE's stacked ``Experts`` in ``edl.nn.moe``, the
per-layer schedules (``plan_schedule``, ``run_segments``) in ``edl.nn.schedule``, the remat
policies in ``edl.nn.stack``.
"""

from edl.nn.attention import Attention
from edl.nn.layers import Embedding, LayerNorm, Linear, RMSNorm
from edl.nn.lora import LoraLinear
from edl.nn.mlp import GatedMLP
from edl.nn.moe import SparseMoE
from edl.nn.quantized import QuantizedLinear
from edl.nn.stack import map_stacked, run_stack, stack

__all__ = [
    "Attention",
    "Embedding",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "LoraLinear",
    "QuantizedLinear",
    "RMSNorm",
    "SparseMoE",
    "map_stacked",
    "run_stack",
    "stack",
]
