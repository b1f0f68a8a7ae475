"""OLMo 2 (HF ``model_type`` olmo2) and OLMo 3 (olmo3).

OLMo 2 is a Llama-style decoder with the residual reordered: no norm before attention or
the MLP, one after each (``h = h + norm(attn(h)); h = h + norm(mlp(h))``,
``DecoderConfig.post_norms``), and q/k RMSNorms over all heads' features at once (``q_norm``
of width ``heads * head_dim``, ``k_norm`` of ``kv_heads * head_dim``, before the heads are
split: ``qk_norm_over_heads``). OLMo 3 adds sliding-window layers (``layer_types``; by
default three sliding layers then a global one, scanned as periods of four), whose RoPE may
differ from the global layers' (``rope_parameters`` per layer type: ``sliding_rope``).
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
from edl.models.rope_config import ropes_from_hf, ropes_to_hf

__all__ = [
    "HF_KEYS",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "Olmo2ForSequenceClassification",
    "Olmo2Model",
    "Olmo3Config",
    "Olmo3ForCausalLM",
    "Olmo3ForSequenceClassification",
    "Olmo3Model",
]

HF_KEYS = decoder_key_table()

_READ = frozenset({"attention_bias", "sliding_window", "layer_types"})


@dataclasses.dataclass(frozen=True)
class Olmo2Config(DecoderConfig):
    """OLMo 2 architecture (defaults: transformers' ``Olmo2Config``)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("olmo2",)
    WRITES: ClassVar[frozenset[str]] = frozenset({"qk_norm_over_heads", "post_norms"})

    model_type: str = "olmo2"
    vocab_size: int = 50304
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    qk_norm: bool = True
    qk_norm_over_heads: bool = True
    post_norms: bool = True

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> Olmo2Config:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        fields = cls._common_from_hf(c)
        bias = bool(c.get("attention_bias", False))
        fields.update(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            qk_norm_over_heads=True,
            post_norms=True,
            **cls._family_from_hf(c, fields),
        )
        return cls._build(c, fields, _READ, overrides)

    @classmethod
    def _family_from_hf(cls, c: Mapping[str, Any], fields: dict) -> dict:
        return {}

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults((*self.GEMMA_FEATURES, "num_experts", "mlp_bias"))
        self._require(
            self.qk_norm
            and self.qk_norm_over_heads
            and self.post_norms
            and self.qkv_bias == self.o_bias,
            "q/k norms over all heads, norms after attention and MLP, one attention bias",
        )
        out = self._common_to_hf(architectures)
        out["attention_bias"] = self.qkv_bias
        out.update(self._windows_to_hf())
        return out

    def _windows_to_hf(self) -> dict[str, Any]:
        self._require(not any(self.layer_windows), "sliding windows (use model_type 'olmo3')")
        return {}


@dataclasses.dataclass(frozen=True)
class Olmo3Config(Olmo2Config):
    """OLMo 3 architecture (defaults: transformers' ``Olmo3Config``): OLMo 2 with sliding
    layers (``layer_windows`` defaults to three sliding layers then a global one)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("olmo3",)
    ROPE_THETA: ClassVar[float] = 500000.0
    WRITES: ClassVar[frozenset[str]] = Olmo2Config.WRITES | {"sliding_rope"}

    model_type: str = "olmo3"
    sliding_window: int | None = 4096

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        return tuple(
            None if (i + 1) % 4 == 0 else self.sliding_window for i in range(self.num_hidden_layers)
        )

    @classmethod
    def _family_from_hf(cls, c: Mapping[str, Any], fields: dict) -> dict:
        n, window = fields["num_hidden_layers"], c.get("sliding_window", 4096)
        layer_types = c.get("layer_types") or [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
        ]
        # transformers reads a legacy ``rope_theta`` for the global layers only (the sliding
        # ones keep the family's default base), as its ``convert_rope_params_to_dict`` does.
        rope, sliding = ropes_from_hf(
            c, fields["head_dim"], full_theta=cls.ROPE_THETA, sliding_theta=cls.ROPE_THETA
        )
        return dict(
            sliding_window=window,
            layer_windows=windows_of_layer_types(layer_types, window, n),
            rope=rope,
            sliding_rope=None if sliding == rope else sliding,
        )

    def _windows_to_hf(self) -> dict[str, Any]:
        sizes = {w for w in self.layer_windows if w is not None}
        self._require(len(sizes) <= 1, f"one sliding_window size, got {sizes}")
        return dict(
            sliding_window=sizes.pop() if sizes else self.sliding_window,
            layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in self.layer_windows
            ],
            **ropes_to_hf(self.rope, self.sliding_rope, self.head_dim),
        )


class Olmo2Model(DecoderModel):
    """The OLMo 2 decoder trunk (norms after attention / MLP, q/k norms over all heads)."""


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 decoder + LM head."""

    trunk: ClassVar[type[DecoderModel]] = Olmo2Model


class Olmo2ForSequenceClassification(DecoderForSequenceClassification):
    """OLMo 2 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Olmo2Model


class Olmo3Model(DecoderModel):
    """The OLMo 3 decoder trunk (OLMo 2's, with sliding-window layers)."""


class Olmo3ForCausalLM(DecoderForCausalLM):
    """OLMo 3 decoder + LM head."""

    trunk: ClassVar[type[DecoderModel]] = Olmo3Model


class Olmo3ForSequenceClassification(DecoderForSequenceClassification):
    """OLMo 3 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Olmo3Model
