"""Pure array functions: attention (full and against a KV cache), linear, RoPE, norms, MoE
routing and expert MLPs, losses, quantization, sampling."""

from edl.ops.attention import attention, attention_mask, reference_attention
from edl.ops.cached_attention import cached_attention, paged_attention
from edl.ops.losses import (
    causal_lm_loss,
    causal_lm_loss_from_logits,
    causal_lm_token_logps,
    cross_entropy,
    mask_without_context,
    sequence_classification_loss,
)
from edl.ops.matmul import linear
from edl.ops.moe import (
    RouterStats,
    expert_mlp,
    load_balancing_loss,
    route,
    router_stats,
    router_z_loss,
)
from edl.ops.norms import layer_norm, rms_norm
from edl.ops.quant import NF4_CODE, dequantize_weight, quantize_weight, quantized_matmul
from edl.ops.rope import RopeConfig, apply_rope, inv_frequencies, rope_tables
from edl.ops.sampling import (
    LogitsProcessor,
    compose,
    greedy,
    min_p,
    processors_for,
    repetition_penalty,
    sample,
    suppress_tokens,
    temperature,
    top_k,
    top_p,
)

__all__ = [
    "NF4_CODE",
    "LogitsProcessor",
    "RopeConfig",
    "RouterStats",
    "apply_rope",
    "attention",
    "attention_mask",
    "cached_attention",
    "causal_lm_loss",
    "causal_lm_loss_from_logits",
    "causal_lm_token_logps",
    "compose",
    "cross_entropy",
    "dequantize_weight",
    "expert_mlp",
    "greedy",
    "inv_frequencies",
    "layer_norm",
    "linear",
    "load_balancing_loss",
    "mask_without_context",
    "min_p",
    "paged_attention",
    "processors_for",
    "quantize_weight",
    "quantized_matmul",
    "reference_attention",
    "repetition_penalty",
    "rms_norm",
    "rope_tables",
    "route",
    "router_stats",
    "router_z_loss",
    "sample",
    "sequence_classification_loss",
    "suppress_tokens",
    "temperature",
    "top_k",
    "top_p",
]
