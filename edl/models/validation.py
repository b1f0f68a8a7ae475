"""Checks of config values before any is used: types and plausible ranges of
``DecoderConfig`` fields and of the HF ``config.json`` keys edl reads.

A mistaken or hostile config (numbers as strings, a bool for an int, a million layers) fails
here in microseconds with the field's name, instead of deep inside ``init`` or ``from_hf``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = []

# Plausibility bounds on sizes and counts, far above every released model (the largest
# have vocabularies of ~262k tokens, hidden sizes up to ~25k, MLPs up to ~74k wide, 126
# layers, 128 heads, head_dim 256, 512 experts and ~10M positions), so that only a mistaken
# or hostile config fails them, in microseconds (a config.json with a million layers took
# 81 s and 1.3 GB to fail).
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**18),
    "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 2**12),
    "num_attention_heads": (1, 2**12),
    "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**12),
    "max_position_embeddings": (1, 2**30),
    "sliding_window": (1, 2**30),
    "num_experts": (0, 2**14),
    "num_experts_per_tok": (1, 2**14),
    "moe_intermediate_size": (1, 2**20),
    "num_labels": (1, 2**24),
    # Vision towers (the largest released use ~1k-pixel images, 14-16 pixel patches).
    "image_size": (1, 2**16),
    "patch_size": (1, 2**12),
    "num_channels": (1, 64),
    "projection_dim": (1, 2**18),
    "projection_size": (1, 2**18),
}


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    """``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and (low is None or value >= low) and (high is None or value <= high):
        return
    kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
    what = kind.get(low, f"an integer >= {low}")
    if is_int and high is not None and value > high:
        what += f" of at most {high} (far beyond any real model)"
    raise ValueError(f"{name} must be {what}, got {value!r}")


def check_number(name: str, value: Any, sign: str | None = None) -> None:
    """``ValueError`` unless ``value`` is a finite int or float (not a bool), and
    ``"positive"`` / ``"non-negative"`` as ``sign`` asks."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and sign == "positive":
        ok = value > 0
    elif ok and sign == "non-negative":
        ok = value >= 0
    if not ok:
        raise ValueError(
            f"{name} must be a {sign + ' ' if sign else 'finite '}number, got {value!r}"
        )


# Signs of the float fields (the others: any finite number).
FLOAT_SIGNS = {
    "rms_norm_eps": "positive",
    "attn_softcap": "positive",
    "final_softcap": "positive",
    "attn_scale": "positive",
    "moe_capacity_factor": "positive",
    "query_pre_attn_scalar": "positive",
    "initializer_range": "non-negative",
    "router_aux_loss_coef": "non-negative",
    "router_z_loss_coef": "non-negative",
    "layer_norm_eps": "positive",
}

# HF config.json keys (of every family) checked before a config is built: they size tuples
# and divide each other on the way. Ints: key -> (low, high, null allowed).
_HF_INTS = {
    **{
        k: (*INT_BOUNDS[k], False)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "num_labels",
            "num_experts",
            "num_experts_per_tok",
        )
    },
    "num_local_experts": (*INT_BOUNDS["num_experts"], False),
    "num_key_value_heads": (*INT_BOUNDS["num_key_value_heads"], True),
    "head_dim": (*INT_BOUNDS["head_dim"], True),
    "moe_intermediate_size": (*INT_BOUNDS["moe_intermediate_size"], True),
    "sliding_window": (0, INT_BOUNDS["sliding_window"][1], True),
    "max_window_layers": (0, INT_BOUNDS["num_hidden_layers"][1], True),
    "decoder_sparse_step": (0, INT_BOUNDS["num_hidden_layers"][1], True),
    "pad_token_id": (None, None, True),
}
# Numbers: key -> (sign, null allowed).
_HF_NUMBERS = {
    "rms_norm_eps": ("positive", False),
    "initializer_range": ("non-negative", False),
    "rope_theta": ("positive", False),
    "attention_dropout": ("non-negative", False),
    "router_aux_loss_coef": ("non-negative", False),
    "router_z_loss_coef": ("non-negative", False),
    "router_jitter_noise": ("non-negative", False),
    "query_pre_attn_scalar": ("positive", False),
    "attn_logit_softcapping": ("positive", True),
    "final_logit_softcapping": ("positive", True),
}
_HF_BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "norm_topk_prob",
    "output_router_logits",
    "use_bidirectional_attention",
)
_HF_TYPES = {  # key -> (JSON type name, Python type); null is allowed
    "model_type": ("a string", str),
    "hidden_act": ("a string", str),
    "hidden_activation": ("a string", str),
    "problem_type": ("a string", str),
    "rope_scaling": ("an object", dict),
    "rope_parameters": ("an object", dict),
    "id2label": ("an object", dict),
    "layer_types": ("a list", list),
    "mlp_only_layers": ("a list", list),
    "architectures": ("a list", list),
}


def check_hf_values(c: Mapping[str, Any]) -> None:
    """Types and plausible ranges of the HF ``config.json`` values edl reads, before any is
    used: ``ValueError("config.json: num_attention_heads must be a positive integer, got
    0")``. Numbers as strings, bools for ints and a million layers all fail here."""
    try:
        for key, (low, high, nullable) in _HF_INTS.items():
            if key in c and not (nullable and c[key] is None):
                check_int(key, c[key], low, high)
        for key, (sign, nullable) in _HF_NUMBERS.items():
            if key in c and not (nullable and c[key] is None):
                check_number(key, c[key], sign)
        for key in _HF_BOOLS:
            if c.get(key) is not None and not isinstance(c[key], bool):
                raise ValueError(f"{key} must be true or false, got {c[key]!r}")
        for key, (name, kind) in _HF_TYPES.items():
            if c.get(key) is not None and not isinstance(c[key], kind):
                raise ValueError(f"{key} must be {name} or null, got {c[key]!r}")
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from e


_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


def check_fields(config: Any, values: Mapping[str, Any]) -> None:
    """Each int / float / bool / str field's type and range (``values``: field -> value as
    given), before any is used."""
    for field in dataclasses.fields(config):
        # Annotations are strings here ("int | None"); a subclass may hold real types.
        kind = field.type if isinstance(field.type, str) else str(field.type)
        kind = _TYPE_NAMES.get(field.type, kind)
        value, optional = values[field.name], kind.endswith(" | None")
        if optional and value is None:
            continue
        kind = kind.removesuffix(" | None")
        if kind == "int":
            check_int(field.name, value, *INT_BOUNDS.get(field.name, (None, None)))
        elif kind == "float":
            check_number(field.name, value, FLOAT_SIGNS.get(field.name))
        elif kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{field.name} must be true or false, got {value!r}")
        elif kind == "str" and not isinstance(value, str):
            raise ValueError(f"{field.name} must be a string, got {value!r}")
