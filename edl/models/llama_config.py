"""``LlamaConfig``: one frozen config for the HF model types llama, mistral, qwen2, qwen3.

``LlamaConfig.from_hf(config_json_dict)`` reads a HF ``config.json`` (transformers 4 or 5
spelling) and refuses options edl would not honour; ``to_hf()`` writes it back, keeping the
keys edl does not interpret. Run-time choices (``scan_layers``, ``remat``,
``attention_impl``) are not HF fields and are never written.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from typing import Any

from edl.nn.mlp import activation
from edl.nn.stack import remat_policy
from edl.ops.rope import RopeConfig

__all__ = ["MODEL_TYPES", "LlamaConfig"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# HF keys that from_hf interprets; everything else is carried through ``hf_extra``.
_READ = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias",
    "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "num_labels", "pad_token_id", "problem_type", "architectures",
    "attention_dropout", "pretraining_tp",
    "dtype", "torch_dtype",  # describe the stored weights; save_pretrained rewrites them
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder (field names as in HF's ``config.json``).

    ``None`` for ``num_key_value_heads``/``head_dim``/``rope`` means the HF default
    (``num_attention_heads``, ``hidden_size // num_attention_heads``, default RoPE with
    theta 10000). ``layer_windows`` gives each layer's sliding window (``None``: full
    attention); ``sliding_window`` alone applies one window to every layer.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope: RopeConfig | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    num_labels: int = 2
    problem_type: str | None = None
    pad_token_id: int | None = None
    # Run-time choices, not HF fields.
    scan_layers: bool = True
    remat: str = "none"
    attention_impl: str = "auto"
    # HF keys edl does not interpret, as sorted (key, JSON) pairs: written back by to_hf.
    hf_extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; LlamaConfig covers {MODEL_TYPES}"
            )
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim"
                )
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.rope is None:
            set_("rope", RopeConfig(dim=self.head_dim))
        if self.layer_windows is None:
            set_("layer_windows", (self.sliding_window,) * self.num_hidden_layers)
        set_("layer_windows", tuple(self.layer_windows))
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive, got {self.layer_windows}")
        activation(self.hidden_act)
        remat_policy(self.remat)
        if self.problem_type not in (
            None,
            "regression",
            "single_label_classification",
            "multi_label_classification",
        ):
            raise ValueError(f"unknown problem_type {self.problem_type!r}")

    def replace(self, **changes: Any) -> LlamaConfig:
        """A copy with ``changes`` (e.g. ``scan_layers=False``, ``remat="full"``).

        Fields that still hold their derived defaults (``head_dim``, the RoPE dim, uniform
        ``layer_windows``) are derived again from the changed fields.
        """
        hidden = changes.get("hidden_size", self.hidden_size)
        heads = changes.get("num_attention_heads", self.num_attention_heads)
        if "head_dim" not in changes:
            derived = self.head_dim == self.hidden_size // self.num_attention_heads
            changes["head_dim"] = hidden // heads if derived else self.head_dim
        head_dim = changes["head_dim"] or hidden // heads
        if "rope" not in changes and self.rope.dim == self.head_dim:
            changes["rope"] = dataclasses.replace(self.rope, dim=head_dim)
        if "layer_windows" not in changes and len(set(self.layer_windows)) <= 1:
            changes["layer_windows"] = None
            changes.setdefault("sliding_window", self.layer_windows[0])
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields (e.g. ``remat``).

        Raises ``ValueError`` for an unsupported ``model_type``, RoPE type, activation or
        layer type, rather than computing something else.
        """
        c = dict(config)
        model_type = c.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"config.json: unsupported model_type {model_type!r}; LlamaConfig covers "
                f"{MODEL_TYPES}"
            )
        heads = c.get("num_attention_heads", 32)
        hidden = c.get("hidden_size", 4096)
        head_dim = c.get("head_dim") or hidden // heads
        n_layers = c.get("num_hidden_layers", 32)
        if c.get("attention_dropout", 0.0):
            warnings.warn(
                f"config.json: attention_dropout={c['attention_dropout']} is ignored (edl "
                "applies no dropout); inference is unaffected",
                stacklevel=2,
            )
        if c.get("pretraining_tp", 1) not in (1, None):
            # Sliced matmuls that sum to the same product: only rounding differs.
            warnings.warn("config.json: pretraining_tp > 1 is computed unsliced", stacklevel=2)
        bias = bool(c.get("attention_bias", False))
        fields = dict(
            model_type=model_type,
            vocab_size=c.get("vocab_size", 32000),
            hidden_size=hidden,
            intermediate_size=c.get("intermediate_size", 11008),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            hidden_act=c.get("hidden_act", "silu"),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            initializer_range=c.get("initializer_range", 0.02),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(c, head_dim),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type in ("qwen2", "mistral") else bias,
            mlp_bias=bool(c.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            layer_windows=_hf_layer_windows(c, model_type, n_layers),
            num_labels=_hf_num_labels(c),
            problem_type=c.get("problem_type"),
            pad_token_id=c.get("pad_token_id"),
            hf_extra=tuple(sorted((k, json.dumps(v)) for k, v in c.items() if k not in _READ)),
        )
        windows = set(fields["layer_windows"])
        if len(windows) == 1:
            fields["sliding_window"] = windows.pop()
        return cls(**{**fields, **overrides})

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers (4 and 5) loads as the same model."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        for labels in ("id2label", "label2id"):  # stale once num_labels was changed
            if labels in out and len(out[labels]) != self.num_labels:
                del out[labels]
        rope = self.rope
        rope_params: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
        if rope.rope_type != "default":
            rope_params["factor"] = rope.factor
        if rope.original_max_position_embeddings is not None:
            rope_params["original_max_position_embeddings"] = rope.original_max_position_embeddings
        if rope.rope_type == "llama3":
            rope_params["low_freq_factor"] = rope.low_freq_factor
            rope_params["high_freq_factor"] = rope.high_freq_factor
        if rope.dim != self.head_dim:
            rope_params["partial_rotary_factor"] = rope.dim / self.head_dim
        out.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=rope.theta,  # transformers 4 spelling ...
            rope_scaling=(
                None if rope.rope_type == "default" else {k: v for k, v in rope_params.items()}
            ),
            rope_parameters=rope_params,  # ... and transformers 5
            pad_token_id=self.pad_token_id,
            num_labels=self.num_labels,
        )
        if self.problem_type is not None:
            out["problem_type"] = self.problem_type
        if architectures is not None:
            out["architectures"] = list(architectures)
        out.update(self._hf_family_fields())
        return out

    def _hf_family_fields(self) -> dict[str, Any]:
        windows = self.layer_windows
        if self.model_type == "llama":
            if self.qkv_bias != self.o_bias or self.qk_norm or any(windows):
                raise ValueError(
                    "this LlamaConfig (split q/k/v vs o bias, qk_norm or sliding windows) has "
                    "no HF 'llama' equivalent; choose the matching model_type"
                )
            return {"attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}
        if self.model_type == "mistral":
            if len(set(windows)) != 1:
                raise ValueError("HF mistral needs the same sliding window on every layer")
            return {"sliding_window": windows[0]}
        # qwen2 / qwen3: per-layer types.
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            raise ValueError(f"HF {self.model_type} has one sliding_window size, got {sizes}")
        first_sliding = next((i for i, w in enumerate(windows) if w is not None), len(windows))
        fields: dict[str, Any] = {
            "use_sliding_window": bool(sizes),
            "sliding_window": sizes.pop() if sizes else None,
            "max_window_layers": first_sliding,  # transformers 4 reads this, 5 layer_types
            "layer_types": [
                "full_attention" if w is None else "sliding_attention" for w in windows
            ],
        }
        if self.model_type == "qwen3":
            fields["attention_bias"] = self.qkv_bias
        return fields


def _hf_num_labels(c: Mapping[str, Any]) -> int:
    if c.get("id2label"):
        return len(c["id2label"])
    return int(c.get("num_labels", 2))


def _hf_layer_windows(
    c: Mapping[str, Any], model_type: str, n_layers: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window under HF's rules for ``model_type``."""
    if model_type == "llama":
        return (None,) * n_layers
    window = c.get("sliding_window")
    if model_type == "mistral":
        return (window,) * n_layers
    if not c.get("use_sliding_window", False):
        window = None
    layer_types = c.get("layer_types")
    if layer_types is None:
        first_sliding = c.get("max_window_layers", n_layers)
        layer_types = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(n_layers)
        ]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != n_layers:
        raise ValueError(
            f"config.json: layer_types must list {n_layers} of 'full_attention' / "
            f"'sliding_attention', got {layer_types}"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
