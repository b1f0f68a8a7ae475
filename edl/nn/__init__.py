"""Equinox layers (HF weight layouts), built with ``Module.init(..., key=...)``."""

from edl.nn.attention import Attention
from edl.nn.encoder import MLP, EncoderAttention, EncoderLayer
from edl.nn.layers import Embedding, LayerNorm, Linear, RMSNorm
from edl.nn.lora import LoraLinear
from edl.nn.mlp import GatedMLP
from edl.nn.moe import Experts, SparseMoE
from edl.nn.quantized import QuantizedLinear
from edl.nn.schedule import ScheduledLayer, Segment, plan_schedule
from edl.nn.stack import REMAT_POLICIES, map_stacked, run_segments, run_stack, stack

__all__ = [
    "MLP",
    "REMAT_POLICIES",
    "Attention",
    "Embedding",
    "EncoderAttention",
    "EncoderLayer",
    "Experts",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "LoraLinear",
    "QuantizedLinear",
    "RMSNorm",
    "ScheduledLayer",
    "Segment",
    "SparseMoE",
    "map_stacked",
    "plan_schedule",
    "run_segments",
    "run_stack",
    "stack",
]
