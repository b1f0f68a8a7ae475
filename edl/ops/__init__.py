"""Pure array functions: attention dispatch + reference, RoPE, norms."""

from edl.ops.attention import attention, attention_mask, reference_attention
from edl.ops.norms import rms_norm
from edl.ops.rope import RopeConfig, apply_rope, inv_frequencies, rope_tables

__all__ = [
    "RopeConfig",
    "apply_rope",
    "attention",
    "attention_mask",
    "inv_frequencies",
    "reference_attention",
    "rms_norm",
    "rope_tables",
]
