"""Gemma (HF ``model_type`` gemma) and Gemma 2 (gemma2).

Gemma is a Llama-style decoder with RMSNorm scaling by ``1 + weight`` (computed in
float32), token embeddings multiplied by ``sqrt(hidden_size)``, a GeGLU MLP
(``gelu_pytorch_tanh``), ``head_dim`` decoupled from the hidden size and a tied head.
Gemma 2 adds soft-capping of the attention logits (``attn_logit_softcapping``) and of the
final logits (``final_logit_softcapping``), sliding-window layers alternating with global
ones (``layer_types``; one scan over pairs of layers), norms after attention and MLP as well
as before, and the attention scale ``query_pre_attn_scalar ** -0.5``.
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
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma2ForSequenceClassification",
    "Gemma2Model",
    "GemmaConfig",
    "GemmaForCausalLM",
    "GemmaForSequenceClassification",
    "GemmaModel",
]

HF_KEYS = decoder_key_table()


def _hidden_act(c: Mapping[str, Any]) -> str:
    """Gemma's activation: ``hidden_activation`` (transformers 4) or ``hidden_act``; the
    legacy ``"gelu"`` of the original releases meant the tanh approximation (as HF maps it)."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


@dataclasses.dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """Gemma architecture (defaults: transformers' ``GemmaConfig``, Gemma 7B)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma",)
    QK_NORM: ClassVar[bool] = False  # whether the HF type has q/k norms (Gemma 3)

    model_type: str = "gemma"
    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    norm_offset: float = 1.0
    embed_scale: bool = True

    _READ: ClassVar[frozenset[str]] = frozenset({"attention_bias", "hidden_activation"})

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> GemmaConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        if c.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported by edl")
        fields = cls._common_from_hf(c, hidden_act=_hidden_act(c))
        bias = bool(c.get("attention_bias", False))
        fields.update(qkv_bias=bias, o_bias=bias, **cls._family_from_hf(c, fields))
        return cls._build(c, fields, cls._READ, overrides)

    @classmethod
    def _family_from_hf(cls, c: Mapping[str, Any], fields: dict) -> dict:
        return {}

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require(
            self.norm_offset == 1.0
            and self.embed_scale
            and self.qk_norm == self.QK_NORM
            and self.qkv_bias == self.o_bias
            and not self.mlp_bias
            and self.num_experts == 0,
            f"Gemma's norm offset 1, scaled embeddings, one attention bias, q/k norms "
            f"{'on' if self.QK_NORM else 'off'}, no MLP bias or experts",
        )
        out = self._common_to_hf(architectures)
        out.update(attention_bias=self.qkv_bias, hidden_activation=self.hidden_act)
        return out


@dataclasses.dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2 architecture (defaults: transformers' ``Gemma2Config``, Gemma 2 2B).

    ``query_pre_attn_scalar`` sets ``attn_scale`` (``query_pre_attn_scalar ** -0.5``);
    ``layer_windows`` defaults to a sliding window on even layers, global attention on odd.
    """

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma2",)

    model_type: str = "gemma2"
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    sliding_window: int | None = 4096
    sandwich_norms: bool = True
    attn_softcap: float | None = 50.0
    final_softcap: float | None = 30.0
    query_pre_attn_scalar: float = 256.0

    _READ: ClassVar[frozenset[str]] = GemmaConfig._READ | {
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
    }

    def _default_attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        return tuple(
            self.sliding_window if i % 2 == 0 else None for i in range(self.num_hidden_layers)
        )

    @classmethod
    def _hf_default_layer_types(cls, c: Mapping[str, Any], n: int) -> list[str]:
        """HF's ``layer_types`` when the file lists none: sliding on even layers."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]

    @classmethod
    def _family_from_hf(cls, c: Mapping[str, Any], fields: dict) -> dict:
        d = cls._default
        window = c.get("sliding_window", d("sliding_window"))
        n = fields["num_hidden_layers"]
        layer_types = c.get("layer_types") or cls._hf_default_layer_types(c, n)
        as_float = lambda x: None if x is None else float(x)
        return dict(
            sliding_window=window,
            layer_windows=windows_of_layer_types(layer_types, window, n),
            attn_softcap=as_float(c.get("attn_logit_softcapping", d("attn_softcap"))),
            final_softcap=as_float(c.get("final_logit_softcapping", d("final_softcap"))),
            query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", d("query_pre_attn_scalar"))),
        )

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        self._require(self.sandwich_norms, "Gemma 2's sandwich norms")
        sizes = {w for w in self.layer_windows if w is not None}
        self._require(len(sizes) <= 1, f"one sliding_window size, got {sizes}")
        out = super().to_hf(architectures)
        scalar = self.query_pre_attn_scalar
        out.update(
            sliding_window=sizes.pop() if sizes else self.sliding_window,
            layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in self.layer_windows
            ],
            attn_logit_softcapping=self.attn_softcap,
            final_logit_softcapping=self.final_softcap,
            query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        )
        return out


class GemmaModel(DecoderModel):
    """The Gemma decoder trunk (scaled embeddings, ``1 + w`` norms)."""


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma decoder + LM head (tied to the embedding unless the config unties it)."""

    trunk: ClassVar[type[DecoderModel]] = GemmaModel


class GemmaForSequenceClassification(DecoderForSequenceClassification):
    """Gemma decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = GemmaModel


class Gemma2Model(DecoderModel):
    """The Gemma 2 decoder trunk (sandwich norms, soft-capped attention)."""


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 decoder + soft-capped LM head."""

    trunk: ClassVar[type[DecoderModel]] = Gemma2Model


class Gemma2ForSequenceClassification(DecoderForSequenceClassification):
    """Gemma 2 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Gemma2Model
