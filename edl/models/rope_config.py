"""RoPE settings in HF ``config.json``: one RoPE for all layers, or one per layer type.

transformers 5 spells a model whose sliding-window layers rotate with their own base (Gemma
3's ``rope_local_base_freq``, OLMo 3) as ``rope_parameters = {"full_attention": {...},
"sliding_attention": {...}}``; older files (and transformers 4) as ``rope_theta`` +
``rope_scaling`` for the global layers and a family-specific key or default for the sliding
ones. ``ropes_from_hf`` reads either spelling into ``(rope, sliding_rope)``;
``rope_to_hf`` / ``ropes_to_hf`` write them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edl.ops.rope import RopeConfig

__all__ = ["LAYER_TYPES", "rope_to_hf", "ropes_from_hf", "ropes_to_hf"]

LAYER_TYPES = ("full_attention", "sliding_attention")


def _nested(c: Mapping[str, Any]) -> dict | None:
    params = c.get("rope_parameters")
    if isinstance(params, Mapping) and any(t in params for t in LAYER_TYPES):
        unknown = set(params) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(
                f"config.json: rope_parameters keys must be {LAYER_TYPES}, got {sorted(params)}"
            )
        return dict(params)
    return None


def ropes_from_hf(
    c: Mapping[str, Any], head_dim: int, *, full_theta: float, sliding_theta: float
) -> tuple[RopeConfig, RopeConfig]:
    """``(rope, sliding_rope)`` of a HF config dict.

    ``full_theta``: the global layers' base when the file names none; ``sliding_theta``: the
    sliding layers' base when ``rope_parameters`` is not per layer type (the family's legacy
    key, e.g. Gemma 3's ``rope_local_base_freq``, or its default). ``rope_scaling`` applies
    to the global layers only, as in transformers.
    """
    nested = _nested(c)
    scaling = dict(c.get("rope_scaling") or {})
    if nested is None:
        full = {**dict(c.get("rope_parameters") or {}), **scaling}
        sliding = {"rope_type": "default", "rope_theta": sliding_theta}
    else:
        full = {**dict(nested.get("full_attention") or {}), **scaling}
        sliding = dict(nested.get("sliding_attention") or {})
        sliding.setdefault("rope_theta", sliding_theta)
    full.setdefault("rope_theta", c.get("rope_theta", full_theta))
    base = {k: c[k] for k in ("max_position_embeddings", "partial_rotary_factor") if k in c}

    def read(params: dict, theta: float) -> RopeConfig:
        params.setdefault("rope_type", "default")
        one = {**base, "rope_parameters": params}
        return RopeConfig.from_hf(one, head_dim, default_theta=theta)

    return read(full, full_theta), read(sliding, sliding_theta)


def rope_to_hf(rope: RopeConfig, head_dim: int) -> dict[str, Any]:
    """One RoPE as a HF ``rope_parameters`` dict: its type's own keys
    (``RopeConfig.hf_parameters``) and a partial rotary's factor."""
    out = dict(rope.hf_parameters())
    if rope.dim != head_dim:
        out["partial_rotary_factor"] = rope.dim / head_dim
    return out


def ropes_to_hf(rope: RopeConfig, sliding_rope: RopeConfig | None, head_dim: int) -> dict:
    """``rope_parameters`` per layer type (the sliding layers' ``sliding_rope``, else
    ``rope``), and ``rope_scaling`` for the global layers as transformers 4 reads it."""
    full = rope_to_hf(rope, head_dim)
    return {
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": rope_to_hf(sliding_rope or rope, head_dim),
        },
        "rope_theta": rope.theta,
        "rope_scaling": None if rope.rope_type == "default" else dict(full),
    }
