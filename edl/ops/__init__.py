"""Pure array functions: attention dispatch + reference, RoPE, norms, losses."""

from edl.ops.attention import attention, attention_mask, reference_attention
from edl.ops.losses import (
    causal_lm_loss,
    causal_lm_loss_from_logits,
    cross_entropy,
    sequence_classification_loss,
)
from edl.ops.norms import rms_norm
from edl.ops.rope import RopeConfig, apply_rope, inv_frequencies, rope_tables

__all__ = [
    "RopeConfig",
    "apply_rope",
    "attention",
    "attention_mask",
    "causal_lm_loss",
    "causal_lm_loss_from_logits",
    "cross_entropy",
    "inv_frequencies",
    "reference_attention",
    "rms_norm",
    "rope_tables",
    "sequence_classification_loss",
]
