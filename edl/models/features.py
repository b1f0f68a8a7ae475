"""What a decoder config's architecture uses, in words: ``features(config)`` lists each
feature it has (``edl info`` prints them under the model's family).

Each feature is an entry of ``FEATURES``: a name and a function of the config giving its
description, or ``None`` when the config lacks it. A family's new feature is one entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from edl._registry import Registry
from edl.models.config import DecoderConfig

__all__ = ["FEATURES", "Feature", "features"]


@dataclasses.dataclass(frozen=True)
class Feature:
    """``describe(config)``: the feature in words, or ``None`` where ``config`` lacks it."""

    name: str
    describe: Callable[[DecoderConfig], str | None]


def _attention(c: DecoderConfig) -> str | None:
    kv, heads = c.num_key_value_heads, c.num_attention_heads
    if kv == heads:
        return None
    kind = "multi-query" if kv == 1 else "grouped-query"
    return f"{kind} attention ({heads} query heads, {kv} key/value head{'s' if kv > 1 else ''})"


def _rope(c: DecoderConfig) -> str:
    r = c.rope
    words = f"RoPE {r.rope_type} (theta {r.theta:g}"
    if r.rope_type != "default":
        words += f", factor {r.factor:g}"
    if r.original_max_position_embeddings is not None and r.rope_type != "dynamic":
        words += f", original context {r.original_max_position_embeddings}"
    if r.attention_scaling != 1.0:
        words += f", attention factor {r.attention_scaling:.4g}"
    if r.dim != c.head_dim:
        words += f", partial rotary: {r.dim} of {c.head_dim} dims"
    return words + ")"


def _windows(c: DecoderConfig) -> str | None:
    sliding = [w for w in c.layer_windows if w is not None]
    if not sliding:
        return None
    sizes = "/".join(str(w) for w in sorted(set(sliding)))
    where = (
        "every layer"
        if len(sliding) == len(c.layer_windows)
        else (f"{len(sliding)} of {len(c.layer_windows)} layers")
    )
    return f"sliding window {sizes} on {where}"


def _moe(c: DecoderConfig) -> str | None:
    moe = c.layer_mlps.count("moe")
    if not moe:
        return None
    dense = len(c.layer_mlps) - moe
    extra = f", {dense} dense layers" if dense else ""
    return f"mixture of experts ({c.num_experts} experts, top {c.num_experts_per_tok}{extra})"


def _biases(c: DecoderConfig) -> str | None:
    names = [n for n, on in (("q/k/v", c.qkv_bias), ("o", c.o_bias), ("MLP", c.mlp_bias)) if on]
    return f"{', '.join(names)} biases" if names else None


def _if(
    flag: Callable[[DecoderConfig], object], words: str
) -> Callable[[DecoderConfig], str | None]:
    return lambda c: words if flag(c) else None


FEATURES: Registry[Feature] = Registry(
    "decoder feature",
    [
        Feature("attention", _attention),
        Feature(
            "fused_projections",
            _if(lambda c: c.FUSED_PROJECTIONS, "fused qkv_proj and gate_up_proj matrices"),
        ),
        Feature("rope", _rope),
        Feature("sliding_window", _windows),
        Feature("qk_norm", _if(lambda c: c.qk_norm, "q/k RMSNorm per head")),
        Feature("biases", _biases),
        Feature("norm_offset", _if(lambda c: c.norm_offset, "RMSNorm scaled by 1 + weight")),
        Feature("embed_scale", _if(lambda c: c.embed_scale, "embeddings times sqrt(hidden)")),
        Feature("sandwich_norms", _if(lambda c: c.sandwich_norms, "norms after attention and MLP")),
        Feature(
            "softcap",
            lambda c: (
                f"soft-capped logits (attention {c.attn_softcap}, final {c.final_softcap})"
                if c.attn_softcap or c.final_softcap
                else None
            ),
        ),
        Feature("moe", _moe),
        Feature("tied_embeddings", _if(lambda c: c.tie_word_embeddings, "tied embeddings")),
    ],
)


def features(config: DecoderConfig) -> list[str]:
    """Each ``FEATURES`` entry's description of ``config``, in order, where it applies."""
    described = (feature.describe(config) for feature in FEATURES.values())
    return [words for words in described if words]
