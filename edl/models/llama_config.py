"""``LlamaConfig``: the HF model types llama, mistral, qwen2 and qwen3.

``LlamaConfig.from_hf(config_json_dict)`` reads a HF ``config.json`` (transformers 4 or 5
spelling) and refuses options edl would not honour; ``to_hf()`` writes it back, keeping the
keys edl does not interpret.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig

__all__ = ["LlamaConfig"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_READ = {
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama-family architecture (defaults: transformers' ``LlamaConfig``)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = MODEL_TYPES

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields (e.g. ``remat``).

        Raises ``ValueError`` for an unsupported ``model_type``, RoPE type, activation or
        layer type, rather than computing something else.
        """
        c = dict(config)
        model_type = cls._check_model_type(c)
        fields = cls._common_from_hf(c)
        bias = bool(c.get("attention_bias", False))
        fields.update(
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type in ("qwen2", "mistral") else bias,
            mlp_bias=bool(c.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            layer_windows=hf_layer_windows(c, model_type, fields["num_hidden_layers"]),
        )
        windows = set(fields["layer_windows"])
        if len(windows) == 1:  # one window everywhere: derived from sliding_window
            fields.update(sliding_window=windows.pop(), layer_windows=None)
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers (4 and 5) loads as the same model."""
        self._require_defaults((*self.GEMMA_FEATURES, "num_experts"))
        out = self._common_to_hf(architectures)
        windows = self.layer_windows
        if self.model_type == "llama":
            self._require(
                self.qkv_bias == self.o_bias and not self.qk_norm and not any(windows),
                "split q/k/v vs o bias, qk_norm or sliding windows; choose the matching model_type",
            )
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            self._require(len(set(windows)) == 1, "the same sliding window on every layer")
            out["sliding_window"] = windows[0]
        else:  # qwen2 / qwen3: per-layer types.
            out.update(hf_window_fields(self))
            if self.model_type == "qwen3":
                out["attention_bias"] = self.qkv_bias
        return out


def hf_layer_windows(
    c: Mapping[str, Any], model_type: str, n_layers: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window under HF's rules for ``model_type`` (llama: none;
    mistral: ``sliding_window`` everywhere; Qwen-style: ``use_sliding_window`` with
    ``layer_types`` or ``max_window_layers``)."""
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
    return windows_of_layer_types(layer_types, window, n_layers)


def windows_of_layer_types(
    layer_types: list[str], window: int | None, n_layers: int
) -> tuple[int | None, ...]:
    """``window`` on ``"sliding_attention"`` layers, ``None`` on ``"full_attention"`` ones."""
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != n_layers:
        raise ValueError(
            f"config.json: layer_types must list {n_layers} of 'full_attention' / "
            f"'sliding_attention', got {layer_types}"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def hf_window_fields(config: DecoderConfig) -> dict[str, Any]:
    """Qwen-style sliding-window fields (transformers 4's ``max_window_layers``, 5's
    ``layer_types``) for ``config.layer_windows``."""
    windows = config.layer_windows
    sizes = {w for w in windows if w is not None}
    config._require(len(sizes) <= 1, f"one sliding_window size, got {sizes}")
    first_sliding = next((i for i, w in enumerate(windows) if w is not None), len(windows))
    return {
        "use_sliding_window": bool(sizes),
        "sliding_window": sizes.pop() if sizes else None,
        "max_window_layers": first_sliding,  # transformers 4 reads this, 5 layer_types
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
    }
