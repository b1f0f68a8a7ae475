"""What a decoder config's architecture uses, in words (``edl info`` prints them after the
model's family).

``features(config)`` lists the features a ``DecoderConfig`` turns on: attention (GQA / MQA,
fused projections, biases, q/k norms per head or over all heads, soft-capping, the query
scale), positions (RoPE type, base and scaling, the sliding layers' own RoPE, NoPE layers),
sliding-window layers, norm placement (pre, sandwich, post), the MLP (dense or MoE),
Gemma's scaled embeddings, the head, and the layer schedule (how many scans over how many
periods). Configs that nest a decoder (LLaVA's ``text_config``) describe it; others give
``[]``.

Each feature is an entry of ``FEATURES``: a name and a function of the config giving its
description, or ``None`` where the config lacks it. A family's new feature is one entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from edl._registry import Registry
from edl.models.config import DecoderConfig
from edl.nn.schedule import plan_schedule
from edl.ops.rope import RopeConfig

__all__ = ["FEATURES", "Feature", "features"]


@dataclasses.dataclass(frozen=True)
class Feature:
    """``describe(config)``: the feature in words, or ``None`` where ``config`` lacks it."""

    name: str
    describe: Callable[[DecoderConfig], str | None]


def _if(
    flag: Callable[[DecoderConfig], object], words: str
) -> Callable[[DecoderConfig], str | None]:
    return lambda c: words if flag(c) else None


def _attention(c: DecoderConfig) -> str | None:
    if getattr(c, "kv_lora_rank", None):  # multi-head latent attention: ``_mla``
        return None
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    kind = "MHA" if kv == heads else "MQA" if kv == 1 else "GQA"
    return f"{kind} {heads}/{kv} heads of {c.head_dim}"


def _mla(c: DecoderConfig) -> str | None:
    """DeepSeek-V3's multi-head latent attention (``edl.models.deepseek_v3``)."""
    rank = getattr(c, "kv_lora_rank", None)
    if not rank:
        return None
    q = f"q rank {c.q_lora_rank}" if c.q_lora_rank else "full-rank q"
    return (
        f"MLA {c.num_attention_heads} heads: {q}, kv latent {rank} + RoPE key "
        f"{c.qk_rope_head_dim}, v {c.v_head_dim}"
    )


def _grouped_routing(c: DecoderConfig) -> str | None:
    """DeepSeek-V3's router and shared experts (``edl.nn.grouped_moe``)."""
    if not getattr(c, "n_group", None) or "moe" not in c.layer_mlps:
        return None
    shared = c.n_shared_experts
    plural = "s" if shared != 1 else ""
    return (
        f"sigmoid routing in {c.topk_group} of {c.n_group} groups, scale "
        f"{c.routed_scaling_factor:g}, {shared} shared expert{plural}"
    )


def _qk_norm(c: DecoderConfig) -> str | None:
    if not c.qk_norm:
        return None
    return "q/k norms over all heads" if c.qk_norm_over_heads else "q/k norms per head"


def _rope_words(rope: RopeConfig, head_dim: int) -> str:
    kind = "" if rope.rope_type == "default" else f" {rope.rope_type} x{rope.factor:g}"
    details = []
    if rope.original_max_position_embeddings is not None and rope.rope_type != "dynamic":
        details.append(f"original context {rope.original_max_position_embeddings}")
    if rope.attention_scaling != 1.0:
        details.append(f"attention factor {rope.attention_scaling:.4g}")
    if rope.dim != head_dim:
        details.append(f"partial rotary: {rope.dim} of {head_dim} dims")
    extra = f" ({', '.join(details)})" if details else ""
    return f"RoPE{kind} theta {rope.theta:g}{extra}"


def _windows(c: DecoderConfig) -> str | None:
    windows = [w for w in c.layer_windows if w is not None]
    if not windows:
        return None
    sizes = ", ".join(str(w) for w in sorted(set(windows)))
    return f"sliding window {sizes} on {len(windows)}/{c.num_hidden_layers} layers"


def _sliding_rope(c: DecoderConfig) -> str | None:
    windows = any(w is not None for w in c.layer_windows)
    if not windows or c.sliding_rope is None or c.sliding_rope == c.rope:
        return None
    return f"sliding layers {_rope_words(c.sliding_rope, c.head_dim)}"


def _norms(c: DecoderConfig) -> str:
    return "post-norms" if c.post_norms else "sandwich norms" if c.sandwich_norms else "pre-norms"


def _moe(c: DecoderConfig) -> str | None:
    moe = c.layer_mlps.count("moe")
    if not moe:
        return None
    return f"MoE {c.num_experts_per_tok} of {c.num_experts} experts on {moe} layers"


def _clamped_swiglu(c: DecoderConfig) -> str | None:
    limit = getattr(c, "swiglu_limit", None)  # GPT-OSS's experts (edl.models.gpt_oss)
    if limit is None or "moe" not in c.layer_mlps:
        return None
    return f"clamped SwiGLU experts with biases (alpha {c.swiglu_alpha:g}, limit {limit:g})"


def _linear_attention(c: DecoderConfig) -> str | None:
    kinds = getattr(c, "layer_types", None) or ()  # Qwen3-Next's hybrid layers
    linear = sum(k == "linear_attention" for k in kinds)
    if not linear:
        return None
    return (
        f"Gated DeltaNet on {linear}/{len(kinds)} layers ({c.linear_num_key_heads} key / "
        f"{c.linear_num_value_heads} value heads of {c.linear_key_head_dim} / "
        f"{c.linear_value_head_dim}, conv {c.linear_conv_kernel_dim}), gated attention on the rest"
    )


def _shared_expert(c: DecoderConfig) -> str | None:
    width = getattr(c, "shared_expert_intermediate_size", None)
    if not width or "moe" not in c.layer_mlps:
        return None
    return f"sigmoid-gated shared expert of width {width}"


def _schedule(c: DecoderConfig) -> str:
    segments = plan_schedule(c.layer_groups, c.layer_settings)
    parts = [f"{s.repeats} x {len(s.block)}" for s in segments]
    return f"{c.num_hidden_layers} layers scanned as {' + '.join(parts)} (repeats x period)"


FEATURES: Registry[Feature] = Registry(
    "decoder feature",
    [
        Feature("attention", _attention),
        Feature("mla", _mla),
        Feature("linear_attention", _linear_attention),
        Feature(
            "fused_projections",
            _if(lambda c: c.FUSED_PROJECTIONS, "fused qkv_proj and gate_up_proj matrices"),
        ),
        Feature("attention_biases", _if(lambda c: c.qkv_bias or c.o_bias, "attention biases")),
        Feature("attention_sinks", _if(lambda c: c.attention_sinks, "attention sinks")),
        Feature("qk_norm", _qk_norm),
        Feature(
            "attention_softcap",
            lambda c: None if c.attn_softcap is None else f"attention soft-cap {c.attn_softcap:g}",
        ),
        Feature(
            "attention_scale",
            lambda c: None if c.attn_scale is None else f"attention scale {c.attn_scale:.4g}",
        ),
        Feature("rope", lambda c: _rope_words(c.rope, c.head_dim)),
        Feature("sliding_window", _windows),
        Feature("sliding_rope", _sliding_rope),
        Feature(
            "nope",
            lambda c: (
                f"NoPE on {len(c.nope_layers)}/{c.num_hidden_layers} layers"
                if c.nope_layers
                else None
            ),
        ),
        Feature("norms", _norms),
        Feature(
            "norm_offset", lambda c: f"norm scale {c.norm_offset:g} + w" if c.norm_offset else None
        ),
        Feature("embed_scale", _if(lambda c: c.embed_scale, "scaled embeddings")),
        Feature("moe", _moe),
        Feature("grouped_routing", _grouped_routing),
        Feature("clamped_swiglu", _clamped_swiglu),
        Feature("shared_expert", _shared_expert),
        Feature("mlp", lambda c: f"{c.hidden_act} MLP" + (" with biases" if c.mlp_bias else "")),
        Feature(
            "final_softcap",
            lambda c: None if c.final_softcap is None else f"final soft-cap {c.final_softcap:g}",
        ),
        Feature("head", lambda c: "tied head" if c.tie_word_embeddings else "untied head"),
        Feature("schedule", _schedule),
    ],
)


def features(config: Any) -> list[str]:
    """Each ``FEATURES`` entry's description of ``config`` (a ``DecoderConfig``, or a config
    nesting one as ``text_config``), in order, where it applies; ``[]`` for other configs."""
    if not isinstance(config, DecoderConfig):
        text = getattr(config, "text_config", None)
        return features(text) if isinstance(text, DecoderConfig) else []
    described = (feature.describe(config) for feature in FEATURES.values())
    return [words for words in described if words]
