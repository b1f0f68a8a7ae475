"""SmolLM3 (HF ``model_type`` smollm3): a Llama-style decoder with NoPE layers.

Every ``no_rope_layer_interval``-th layer (4: layers 3, 7, 11, ...) applies no rotary
embedding (``no_rope_layers[i] == 0``; ``DecoderConfig.nope_layers``), so a 36-layer model
runs as nine scanned periods of three RoPE layers and one NoPE layer. With
``use_sliding_window``, the NoPE layers attend through a sliding window (HF's default
``layer_types``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig
from edl.models.decoder import DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table
from edl.models.llama_config import windows_of_layer_types

__all__ = [
    "HF_KEYS",
    "SmolLM3Config",
    "SmolLM3ForCausalLM",
    "SmolLM3ForSequenceClassification",
    "SmolLM3Model",
]

HF_KEYS = decoder_key_table()

_READ = frozenset(
    {
        "attention_bias",
        "mlp_bias",
        "use_sliding_window",
        "sliding_window",
        "no_rope_layers",
        "no_rope_layer_interval",
        "layer_types",
    }
)


def hf_nope_layers(c: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """The layers without RoPE under HF's rules (``no_rope_layers[i] == 0``; default every
    ``no_rope_layer_interval``-th layer)."""
    flags = c.get("no_rope_layers")
    if flags is None:
        interval = c.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"config.json: no_rope_layer_interval must be a positive integer, got {interval!r}"
            )
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or set(flags) - {0, 1}:
        raise ValueError(
            f"config.json: no_rope_layers must list {n_layers} flags of 0 / 1, got {flags!r}"
        )
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _hf_windows(c: Mapping[str, Any], nope: tuple[int, ...], n: int) -> tuple[int | None, ...]:
    window = c.get("sliding_window")
    sliding = bool(c.get("use_sliding_window", False)) and window is not None
    layer_types = c.get("layer_types") or [
        "sliding_attention" if sliding and i in nope else "full_attention" for i in range(n)
    ]
    if not sliding and "sliding_attention" in layer_types:
        # HF's sliding mask would use sliding_window while its attention layers do not.
        raise ValueError(
            "config.json: layer_types names sliding layers but use_sliding_window is off or "
            "sliding_window is null; edl does not guess which one transformers honours"
        )
    return windows_of_layer_types(layer_types, window if sliding else None, n)


@dataclasses.dataclass(frozen=True)
class SmolLM3Config(DecoderConfig):
    """SmolLM3 architecture (defaults: transformers' ``SmolLM3Config``, SmolLM3-3B);
    ``nope_layers`` defaults to every fourth layer."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("smollm3",)
    ROPE_THETA: ClassVar[float] = 2000000.0
    WRITES: ClassVar[frozenset[str]] = frozenset({"nope_layers"})

    model_type: str = "smollm3"
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 128004

    def _default_nope_layers(self) -> tuple[int, ...]:
        return tuple(range(3, self.num_hidden_layers, 4))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> SmolLM3Config:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        fields = cls._common_from_hf(c)
        n = fields["num_hidden_layers"]
        bias = bool(c.get("attention_bias", False))
        nope = hf_nope_layers(c, n)
        fields.update(
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            nope_layers=nope,
            layer_windows=_hf_windows(c, nope, n),
        )
        windows = set(fields["layer_windows"])
        if len(windows) == 1:  # one window everywhere: derived from sliding_window
            fields.update(sliding_window=windows.pop(), layer_windows=None)
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults((*self.GEMMA_FEATURES, "num_experts"))
        self._require(
            self.qkv_bias == self.o_bias and not self.qk_norm,
            "one attention bias and no q/k norms",
        )
        windows = self.layer_windows
        sizes = {w for w in windows if w is not None}
        self._require(len(sizes) <= 1, f"one sliding_window size, got {sizes}")
        out = self._common_to_hf(architectures)
        nope = set(self.nope_layers)
        out.update(
            attention_bias=self.qkv_bias,
            mlp_bias=self.mlp_bias,
            use_sliding_window=bool(sizes),
            sliding_window=sizes.pop() if sizes else None,
            no_rope_layers=[int(i not in nope) for i in range(self.num_hidden_layers)],
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        )
        return out


class SmolLM3Model(DecoderModel):
    """The SmolLM3 decoder trunk (NoPE layers among RoPE ones)."""


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3 decoder + LM head (tied to the embedding unless the config unties it)."""

    trunk: ClassVar[type[DecoderModel]] = SmolLM3Model


class SmolLM3ForSequenceClassification(DecoderForSequenceClassification):
    """SmolLM3 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = SmolLM3Model
