"""Llama-family decoders (HF ``model_type`` llama, mistral, qwen2, qwen3) and task heads.

The classes are ``edl.models.decoder``'s under HF's names; the family's features (GQA,
q/k/v and o biases, Qwen3's q/k norms, Mistral / Qwen2 sliding windows, RoPE scaling) are
configuration (``LlamaConfig``)::

    config = LlamaConfig.from_hf(json.load(open("config.json")))
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    logits = model(input_ids, attention_mask=mask).logits
    loss, metrics = model.compute_loss(input_ids, attention_mask=mask)
"""

from __future__ import annotations

from typing import ClassVar

from edl.models.decoder import PARTITION_RULES, DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table
from edl.models.llama_config import LlamaConfig

__all__ = [
    "HF_KEYS",
    "PARTITION_RULES",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaModel",
]

# HF names are edl's, plus the layer stacking.
HF_KEYS = decoder_key_table(
    # Buffers some older checkpoints saved; edl computes RoPE tables in the forward pass.
    ignore_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)


class LlamaModel(DecoderModel):
    """The Llama-family decoder trunk: embeddings, stacked decoder layers, final norm."""


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama-family decoder + LM head (``lm_head`` ``None`` when tied to the embedding)."""

    trunk: ClassVar[type[DecoderModel]] = LlamaModel


class LlamaForSequenceClassification(DecoderForSequenceClassification):
    """Llama-family decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = LlamaModel
