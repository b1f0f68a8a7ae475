"""Pure array functions: attention (full and against a KV cache), linear, RoPE, norms, MoE
routing and expert MLPs, losses, quantization, sampling.

The names below are the entry points a model author calls; the rest is in the defining
module: logits processors and sampling (``edl.ops.sampling``), MoE routing and expert MLPs
(``edl.ops.moe``), the other losses (``edl.ops.losses``), the reference attention and masks
(``edl.ops.attention``), the quantization formats (``edl.ops.quant``).
"""

from edl.ops.attention import attention, attention_mask
from edl.ops.cached_attention import cached_attention, paged_attention
from edl.ops.losses import causal_lm_loss, causal_lm_loss_from_logits, cross_entropy
from edl.ops.matmul import linear
from edl.ops.norms import layer_norm, rms_norm
from edl.ops.quant import dequantize_weight, quantize_weight, quantized_matmul
from edl.ops.rope import RopeConfig, apply_rope, rope_tables

__all__ = [
    "RopeConfig",
    "apply_rope",
    "attention",
    "attention_mask",
    "cached_attention",
    "causal_lm_loss",
    "causal_lm_loss_from_logits",
    "cross_entropy",
    "dequantize_weight",
    "layer_norm",
    "linear",
    "paged_attention",
    "quantize_weight",
    "quantized_matmul",
    "rms_norm",
    "rope_tables",
]
