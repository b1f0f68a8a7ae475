"""SigLIP (HF ``model_type`` siglip, siglip_text_model, siglip_vision_model): the towers and
the dual model with its pairwise sigmoid loss.

As transformers (5.x) builds them: the text tower pools its last token through ``head``
(a linear layer), the vision tower has no class token and pools with an attention-pooling
``head`` (``vision_use_head``); ``SiglipModel`` holds both plus ``logit_scale`` and
``logit_bias`` (each of shape ``(1,)``). The bare towers' keys carry no ``text_model.`` /
``vision_model.`` prefix (older files' prefixed keys load too).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.clip import ENCODER_PARTITION_RULES, CLIPOutput, _with_metrics
from edl.models.encoder_config import SiglipConfig, SiglipTextConfig, SiglipVisionConfig
from edl.models.towers import (
    AttentionPoolingHead,
    Encoder,
    EncoderOutput,
    TextEmbeddings,
    VisionEmbeddings,
)
from edl.module import require_float_dtype
from edl.nn.layers import LayerNorm, Linear
from edl.ops.attention import padding_segments
from edl.ops.contrastive import image_text_logits, l2_normalize, sigmoid_loss
from edl.ops.sharding import Rules

__all__ = ["SiglipModel", "SiglipTextModel", "SiglipVisionModel"]

Ids = Int[Array, "batch seq"]
Mask = Int[Array, "batch seq"] | jax.Array
Pixels = Float[Array, "batch channels height width"]


def _norm(config: SiglipTextConfig | SiglipVisionConfig, dtype: DTypeLike) -> LayerNorm:
    return LayerNorm.init(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)


class SiglipTextModel(eqx.Module):
    """SigLIP's text tower: bidirectional encoder, final ``LayerNorm``; pooled at the last
    position (SigLIP pads to a fixed length) through ``head``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    embeddings: TextEmbeddings
    encoder: Encoder
    final_layer_norm: LayerNorm
    head: Linear
    config: SiglipTextConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: SiglipTextConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> SiglipTextModel:
        """Random weights (normal(0, initializer_range), norms 1); ``dtype`` floating."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_emb, k_enc, k_head = jax.random.split(key, 3)
        head = Linear.init(
            config.hidden_size,
            config.head_size,
            use_bias=True,
            std=config.initializer_range,
            dtype=dtype,
            key=k_head,
        )
        return cls(
            TextEmbeddings.init(config, dtype=dtype, key=k_emb),
            Encoder.init(config, dtype=dtype, key=k_enc),
            _norm(config, dtype),
            head,
            config,
        )

    def __call__(
        self,
        input_ids: Ids,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """``last_hidden_state`` (after the final norm) and ``pooler_output``, ``head`` of the
        last position's state ``(batch, projection_size)``."""
        c = self.config
        h = self.embeddings(input_ids, config=c, position_ids=position_ids)
        h, hidden = self.encoder(
            h,
            config=c,
            segment_ids=padding_segments(attention_mask),
            output_hidden_states=output_hidden_states,
        )
        h = self.final_layer_norm(h)
        return EncoderOutput(h, self.head(h[:, -1]), hidden)


class SiglipVisionModel(eqx.Module):
    """SigLIP's vision tower: patches (conv with bias) + positions, encoder,
    ``post_layernorm``, and (``vision_use_head``) the attention-pooling ``head``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    embeddings: VisionEmbeddings
    encoder: Encoder
    post_layernorm: LayerNorm
    head: AttentionPoolingHead | None
    config: SiglipVisionConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: SiglipVisionConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> SiglipVisionModel:
        """Random weights (normal(0, initializer_range), norms 1); ``dtype`` floating."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_emb, k_enc, k_head = jax.random.split(key, 3)
        embeddings = VisionEmbeddings.init(
            config, class_token=False, patch_bias=True, dtype=dtype, key=k_emb
        )
        head = None
        if config.vision_use_head:
            head = AttentionPoolingHead.init(config, dtype=dtype, key=k_head)
        encoder = Encoder.init(config, dtype=dtype, key=k_enc)
        return cls(embeddings, encoder, _norm(config, dtype), head, config)

    def __call__(
        self, pixel_values: Pixels, *, output_hidden_states: bool = False
    ) -> EncoderOutput:
        """``last_hidden_state`` ``(batch, patches, dim)`` after ``post_layernorm``;
        ``pooler_output`` the head's pooled embedding (``None`` without a head);
        ``hidden_states`` the encoder's input and each layer's output."""
        c = self.config
        h = self.embeddings(pixel_values, config=c)
        h, hidden = self.encoder(h, config=c, output_hidden_states=output_hidden_states)
        h = self.post_layernorm(h)
        return EncoderOutput(h, None if self.head is None else self.head(h), hidden)


class SiglipModel(eqx.Module):
    """Both towers and the sigmoid loss's learned ``logit_scale`` and ``logit_bias``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    text_model: SiglipTextModel
    vision_model: SiglipVisionModel
    logit_scale: Float[Array, " 1"]
    logit_bias: Float[Array, " 1"]
    config: SiglipConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: SiglipConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> SiglipModel:
        """Random towers; ``logit_scale = log(10)``, ``logit_bias = -10`` (SigLIP's start)."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        if not config.vision_config.vision_use_head:
            raise ValueError("SiglipModel pools images with the vision head: vision_use_head")
        k_text, k_vision = jax.random.split(key)
        return cls(
            SiglipTextModel.init(config.text_config, key=k_text, dtype=dtype),
            SiglipVisionModel.init(config.vision_config, key=k_vision, dtype=dtype),
            jnp.full((1,), jnp.log(10.0), dtype),
            jnp.full((1,), -10.0, dtype),
            config,
        )

    def get_text_features(
        self,
        input_ids: Ids,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
    ) -> Float[Array, "batch proj"]:
        """The pooled text embeddings (not normalised)."""
        out = self.text_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return out.pooler_output

    def get_image_features(self, pixel_values: Pixels) -> Float[Array, "batch proj"]:
        """The pooled image embeddings (not normalised)."""
        return self.vision_model(pixel_values).pooler_output

    def __call__(
        self,
        input_ids: Ids,
        pixel_values: Pixels,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
    ) -> CLIPOutput:
        """Every text against every image: ``cos * exp(logit_scale) + logit_bias``
        (``sigmoid(logits_per_image)`` are the match probabilities)."""
        text = self.text_model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=output_hidden_states,
        )
        vision = self.vision_model(pixel_values, output_hidden_states=output_hidden_states)
        text_embeds, image_embeds = (
            l2_normalize(text.pooler_output),
            l2_normalize(vision.pooler_output),
        )
        logits = image_text_logits(text_embeds, image_embeds, self.logit_scale, self.logit_bias)
        return CLIPOutput(logits.T, logits, text_embeds, image_embeds, text, vision)

    def compute_loss(
        self,
        input_ids: Ids,
        pixel_values: Pixels,
        *,
        attention_mask: Mask | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """SigLIP's sigmoid loss over a batch of matching (text i, image i) pairs:
        ``(loss, {"loss", "accuracy"})``."""
        logits = self(input_ids, pixel_values, attention_mask=attention_mask).logits_per_text
        return _with_metrics(sigmoid_loss(logits), logits)
