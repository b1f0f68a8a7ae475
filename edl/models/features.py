"""What a decoder config's architecture uses, in words (``edl info`` prints it).

``features(config)`` lists the features a ``DecoderConfig`` turns on: attention (GQA / MQA,
biases, q/k norms per head or over all heads, soft-capping, the query scale), positions
(RoPE type and bases, the sliding layers' own RoPE, NoPE layers), sliding-window layers,
norm placement (pre, sandwich, post), MLP (dense or MoE), Gemma's scaled embeddings, a
tied head, and the layer schedule (how many scans over how many periods). Configs that
nest a decoder (LLaVA's ``text_config``) describe it; others give ``[]``.
"""

from __future__ import annotations

from typing import Any

from edl.models.config import DecoderConfig
from edl.nn.schedule import plan_schedule
from edl.ops.rope import RopeConfig

__all__ = ["features"]


def _rope(rope: RopeConfig) -> str:
    kind = "" if rope.rope_type == "default" else f" {rope.rope_type} x{rope.factor:g}"
    return f"RoPE{kind} theta {rope.theta:g}"


def _attention(c: DecoderConfig) -> list[str]:
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    kind = "MHA" if kv == heads else "MQA" if kv == 1 else "GQA"
    out = [f"{kind} {heads}/{kv} heads of {c.head_dim}"]
    if c.qkv_bias or c.o_bias:
        out.append("attention biases")
    if c.qk_norm:
        out.append("q/k norms over all heads" if c.qk_norm_over_heads else "q/k norms per head")
    if c.attn_softcap is not None:
        out.append(f"attention soft-cap {c.attn_softcap:g}")
    if c.attn_scale is not None:
        out.append(f"attention scale {c.attn_scale:.4g}")
    return out


def _positions(c: DecoderConfig) -> list[str]:
    out = [_rope(c.rope)]
    windows = [w for w in c.layer_windows if w is not None]
    if windows:
        sizes = ", ".join(str(w) for w in sorted(set(windows)))
        out.append(f"sliding window {sizes} on {len(windows)}/{c.num_hidden_layers} layers")
    if windows and c.sliding_rope is not None and c.sliding_rope != c.rope:
        out.append(f"sliding layers {_rope(c.sliding_rope)}")
    if c.nope_layers:
        out.append(f"NoPE on {len(c.nope_layers)}/{c.num_hidden_layers} layers")
    return out


def _layout(c: DecoderConfig) -> list[str]:
    out = ["post-norms" if c.post_norms else "sandwich norms" if c.sandwich_norms else "pre-norms"]
    if c.norm_offset:
        out.append(f"norm scale {c.norm_offset:g} + w")
    if c.embed_scale:
        out.append("scaled embeddings")
    moe = c.layer_mlps.count("moe")
    if moe:
        out.append(f"MoE {c.num_experts_per_tok} of {c.num_experts} experts on {moe} layers")
    out.append(f"{c.hidden_act} MLP" + (" with biases" if c.mlp_bias else ""))
    if c.final_softcap is not None:
        out.append(f"final soft-cap {c.final_softcap:g}")
    out.append("tied head" if c.tie_word_embeddings else "untied head")
    return out


def _schedule(c: DecoderConfig) -> str:
    segments = plan_schedule(c.layer_groups, c.layer_settings)
    parts = [f"{s.repeats} x {len(s.block)}" for s in segments]
    return f"{c.num_hidden_layers} layers scanned as {' + '.join(parts)} (repeats x period)"


def features(config: Any) -> list[str]:
    """The architecture features of ``config`` (a ``DecoderConfig``, or a config nesting one
    as ``text_config``), one short phrase each; ``[]`` for other configs."""
    if not isinstance(config, DecoderConfig):
        text = getattr(config, "text_config", None)
        return features(text) if isinstance(text, DecoderConfig) else []
    c = config
    return [*_attention(c), *_positions(c), *_layout(c), _schedule(c)]
