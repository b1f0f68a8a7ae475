"""Phi-3 / Phi-3.5 / Phi-4-mini (HF ``model_type`` phi3): a Llama-style decoder whose HF layout
fuses q/k/v into one ``self_attn.qkv_proj`` and gate/up into one ``mlp.gate_up_proj``.

edl's layers hold those fused matrices under HF's names (``DecoderConfig.FUSED_PROJECTIONS``),
so the key table is the plain one and LoRA, PEFT files, quantization and the partition rules
(``qkv_proj`` / ``gate_up_proj`` split their outputs over ``tp`` as q/k/v and gate/up do) see
HF's modules. LongRoPE (``rope_type`` longrope, older configs "su" or "yarn") with short and
long factors, partial rotary (Phi-4-mini's ``partial_rotary_factor`` 0.75), a sliding window
on every layer, tied or untied embeddings::

    model = edl.from_pretrained("microsoft/Phi-4-mini-instruct")

Generation across ``original_max_position_embeddings`` follows transformers' Phi-3
``generate``: the step that first grows a sequence past it re-runs the prompt and the tokens
generated so far as one prefill (long factors everywhere from then on) rather than decoding
one token (``edl.generate`` and ``generate_stream``; beam search, speculative decoding and
the serving engine keep decoding token by token, their cached keys rotated by the short
factors). As in transformers, one call picks short or long factors for all its rows by its
longest: the serving engine's rows share a step, so a request past the original context
switches the factors of the requests decoded beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig
from edl.models.decoder import DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table

__all__ = [
    "HF_KEYS",
    "Phi3Config",
    "Phi3ForCausalLM",
    "Phi3ForSequenceClassification",
    "Phi3Model",
]

HF_KEYS = decoder_key_table(ignore_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

# transformers' Phi3Config default: the pretraining context its LongRoPE falls back on.
_ORIGINAL_DEFAULT = 4096
_READ = {"sliding_window"}  # original_max_position_embeddings stays in hf_extra


@dataclasses.dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    """Phi-3 architecture (defaults: transformers' ``Phi3Config``, Phi-3-mini-4k)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("phi3",)
    FUSED_PROJECTIONS: ClassVar[bool] = True
    # transformers' Phi-3 generate re-runs the whole sequence when it first grows past
    # LongRoPE's original context (edl.generate.steps.refill_length).
    REFILL_PAST_ORIGINAL_CONTEXT: ClassVar[bool] = True

    model_type: str = "phi3"
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 32000

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> Phi3Config:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields (e.g. ``remat``).

        As transformers: rope types "su" and "yarn" mean longrope; longrope takes the
        top-level ``original_max_position_embeddings`` (default 4096) over the one in the
        RoPE parameters, but for "su"; rope types other than default / longrope raise."""
        c = dict(config)
        cls._check_model_type(c)
        c["rope_parameters"] = _phi3_rope_parameters(c)
        c.pop("rope_scaling", None)
        fields = cls._common_from_hf(c)
        fields["sliding_window"] = c.get("sliding_window")
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults((*self.GEMMA_FEATURES, "num_experts"))
        self._require(
            not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm),
            "biases or qk_norm",
        )
        self._require(self.rope.rope_type in ("default", "longrope"), "rope types but longrope")
        windows = self.layer_windows
        self._require(len(set(windows)) == 1, "the same sliding window on every layer")
        out = self._common_to_hf(architectures)
        out["sliding_window"] = windows[0]
        if self.rope.rope_type == "longrope":  # transformers reads the top-level one
            out["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        return out


def _phi3_rope_parameters(c: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as transformers' ``Phi3Config`` standardises them."""
    params = {**dict(c.get("rope_scaling") or {}), **dict(c.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("llama3", "yarn", "longrope"):  # not "su": renamed after this rule
        params["original_max_position_embeddings"] = c.get(
            "original_max_position_embeddings", _ORIGINAL_DEFAULT
        )
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise ValueError(
            f"config.json: phi3 models take rope types default or longrope (su), got {rope_type!r}"
        )
    params.pop("type", None)
    return {**params, "rope_type": rope_type}


class Phi3Model(DecoderModel):
    """The Phi-3 decoder trunk: embeddings, stacked decoder layers, final norm."""


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 decoder + LM head (``lm_head`` ``None`` when tied to the embedding)."""

    trunk: ClassVar[type[DecoderModel]] = Phi3Model


class Phi3ForSequenceClassification(DecoderForSequenceClassification):
    """Phi-3 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Phi3Model
