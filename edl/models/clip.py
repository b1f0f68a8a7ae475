"""CLIP (HF ``model_type`` clip, clip_text_model, clip_vision_model): the text and vision
towers, their projections and the dual model with its contrastive loss.

Module trees and names are transformers' (5.x): ``CLIPModel`` holds ``text_model``,
``vision_model``, ``text_projection``, ``visual_projection`` and ``logit_scale``; the bare
towers (``CLIPTextModel``, ``CLIPVisionModel``) are those towers themselves, as
transformers 5 saves them (keys without a ``text_model.`` / ``vision_model.`` prefix; the
prefixed layout of older files loads too)::

    model = edl.from_pretrained("openai/clip-vit-base-patch32")
    out = model(input_ids, pixel_values, attention_mask=mask)
    out.logits_per_image            # (images, texts)
    loss, metrics = model.compute_loss(input_ids, pixel_values, attention_mask=mask)
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.encoder_config import CLIPConfig, CLIPTextConfig, CLIPVisionConfig
from edl.models.keymap import KeyTable
from edl.models.towers import (
    Encoder,
    EncoderOutput,
    TextEmbeddings,
    VisionEmbeddings,
)
from edl.module import require_float_dtype
from edl.nn.layers import LayerNorm, Linear
from edl.ops.attention import padding_segments
from edl.ops.contrastive import clip_loss, image_text_logits, l2_normalize
from edl.ops.sharding import Rules

__all__ = [
    "CLIPModel",
    "CLIPOutput",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "CLIPVisionModel",
    "CLIPVisionModelWithProjection",
    "ProjectionOutput",
]

Ids = Int[Array, "batch seq"]
Mask = Int[Array, "batch seq"] | jax.Array
Pixels = Float[Array, "batch channels height width"]

# Encoder towers split as the decoders do: q/k/v and fc1 by output features over tp, out
# and fc2 by input features; the stacked layer axis is never split. Embeddings split their
# features; norms, biases of row-split layers and the small heads are replicated.
_BASE = r"(\.base_layer)?"
ENCODER_PARTITION_RULES: Rules = (
    (rf"layers\.self_attn\.(q_proj|k_proj|v_proj){_BASE}\.weight$", P(None, "tp", "fsdp")),
    (rf"layers\.self_attn\.(q_proj|k_proj|v_proj){_BASE}\.bias$", P(None, "tp")),
    (rf"layers\.mlp\.fc1{_BASE}\.weight$", P(None, "tp", "fsdp")),
    (rf"layers\.mlp\.fc1{_BASE}\.bias$", P(None, "tp")),
    (rf"layers\.(self_attn\.out_proj|mlp\.fc2){_BASE}\.weight$", P(None, "fsdp", "tp")),
    (r"(token_embedding|position_embedding)\.weight$", P(None, ("tp", "fsdp"))),
    (r".*", P()),
)


def tower_key_table(hf_prefix: str, edl_prefix: str, *, legacy: tuple[str, ...] = ()) -> tuple:
    """Key rules of one tower whose HF keys start with ``hf_prefix`` and edl paths with
    ``edl_prefix`` (the layer stack under ``encoder.layers``); ``legacy``: other HF prefixes
    that load the same tower (older files), never written. They come first: the main
    prefix's catch-all would otherwise claim their keys."""
    rules = []
    for old in legacy:
        rules += [
            (
                f"{old}encoder.layers.{{layer}}.{{name}}",
                f"{edl_prefix}encoder.layers.{{name}}",
                None,
                True,
            ),
            (f"{old}{{name}}", f"{edl_prefix}{{name}}", None, True),
        ]
    return (
        *rules,
        (f"{hf_prefix}encoder.layers.{{layer}}.{{name}}", f"{edl_prefix}encoder.layers.{{name}}"),
        (f"{hf_prefix}{{name}}", f"{edl_prefix}{{name}}"),
    )


# Buffers older files saved; edl computes positions in the forward pass.
IGNORED = (r"(.*\.)?embeddings\.position_ids",)


def dual_key_table() -> KeyTable:
    """The dual models' and the ``...WithProjection`` towers' table: HF keys equal edl
    paths but for the stacked encoder layers (``text_model.`` / ``vision_model.``)."""
    rules = (
        *tower_key_table("text_model.", "text_model."),
        *tower_key_table("vision_model.", "vision_model."),
        ("{name}", "{name}"),
    )
    return KeyTable(rules, ignore_hf=IGNORED)


def bare_tower_key_table(prefix: str) -> KeyTable:
    """A bare tower's table: transformers 5's unprefixed keys, or ``prefix`` (older files)."""
    return KeyTable(tower_key_table("", "", legacy=(prefix,)), ignore_hf=IGNORED)


class ProjectionOutput(eqx.Module):
    """A ``...WithProjection`` tower's ``embeds`` (HF's ``text_embeds`` / ``image_embeds``:
    the projected pooled output, not normalised), ``last_hidden_state`` and, when asked,
    ``hidden_states``."""

    embeds: Float[Array, "batch proj"]
    last_hidden_state: Float[Array, "batch seq dim"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None


class CLIPOutput(eqx.Module):
    """``logits_per_image`` ``(images, texts)`` and ``logits_per_text`` (its transpose),
    the L2-normalised projected ``text_embeds`` / ``image_embeds``, and each tower's own
    output."""

    logits_per_image: Float[Array, "images texts"]
    logits_per_text: Float[Array, "texts images"]
    text_embeds: Float[Array, "texts proj"]
    image_embeds: Float[Array, "images proj"]
    text_model_output: EncoderOutput
    vision_model_output: EncoderOutput


def _norm(config: CLIPTextConfig | CLIPVisionConfig, dtype: DTypeLike) -> LayerNorm:
    return LayerNorm.init(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)


def _dtype(cls: type, dtype: DTypeLike) -> DTypeLike:
    return require_float_dtype(dtype, f"{cls.__name__}.init: dtype")


class CLIPTextModel(eqx.Module):
    """CLIP's text tower: causal encoder over token + position embeddings, final
    ``LayerNorm``; pooled at each row's end-of-text token."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    embeddings: TextEmbeddings
    encoder: Encoder
    final_layer_norm: LayerNorm
    config: CLIPTextConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: CLIPTextConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> CLIPTextModel:
        """Random weights (normal(0, initializer_range), norms 1); ``dtype`` floating."""
        dtype = _dtype(cls, dtype)
        k_emb, k_enc = jax.random.split(key)
        return cls(
            TextEmbeddings.init(config, dtype=dtype, key=k_emb),
            Encoder.init(config, dtype=dtype, key=k_enc),
            _norm(config, dtype),
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
        """``last_hidden_state`` (after the final norm) and ``pooler_output``: the state at
        the first ``eos_token_id`` of each row (for the legacy ``eos_token_id == 2`` of
        older configs, at each row's largest id, as transformers does)."""
        c = self.config
        h = self.embeddings(input_ids, config=c, position_ids=position_ids)
        h, hidden = self.encoder(
            h,
            config=c,
            segment_ids=padding_segments(attention_mask),
            causal=True,
            output_hidden_states=output_hidden_states,
        )
        h = self.final_layer_norm(h)
        if c.eos_token_id is None:
            raise ValueError("CLIPTextModel pools at eos_token_id, which this config lacks")
        ends = input_ids if c.eos_token_id == 2 else (input_ids == c.eos_token_id)
        last = jnp.argmax(ends.astype(jnp.int32), axis=-1)
        pooled = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        return EncoderOutput(h, pooled, hidden)


class CLIPVisionModel(eqx.Module):
    """CLIP's vision tower: class token + patches + positions, ``pre_layrnorm`` (HF's
    spelling), encoder; pooled at the class token after ``post_layernorm``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    embeddings: VisionEmbeddings
    pre_layrnorm: LayerNorm
    encoder: Encoder
    post_layernorm: LayerNorm
    config: CLIPVisionConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: CLIPVisionConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> CLIPVisionModel:
        """Random weights (normal(0, initializer_range), norms 1); ``dtype`` floating."""
        dtype = _dtype(cls, dtype)
        k_emb, k_enc = jax.random.split(key)
        embeddings = VisionEmbeddings.init(
            config, class_token=True, patch_bias=False, dtype=dtype, key=k_emb
        )
        encoder = Encoder.init(config, dtype=dtype, key=k_enc)
        return cls(embeddings, _norm(config, dtype), encoder, _norm(config, dtype), config)

    def __call__(
        self, pixel_values: Pixels, *, output_hidden_states: bool = False
    ) -> EncoderOutput:
        """``last_hidden_state`` ``(batch, 1 + patches, dim)`` (the last layer's output, not
        normalised, as in transformers) and ``pooler_output`` (the normalised class token).
        ``hidden_states[0]`` is the encoder's input (after ``pre_layrnorm``)."""
        c = self.config
        h = self.pre_layrnorm(self.embeddings(pixel_values, config=c))
        h, hidden = self.encoder(h, config=c, output_hidden_states=output_hidden_states)
        return EncoderOutput(h, self.post_layernorm(h[:, 0]), hidden)


def _projection(dim: int, out: int, dtype: DTypeLike, key: PRNGKeyArray) -> Linear:
    return Linear.init(dim, out, std=dim**-0.5, dtype=dtype, key=key)


class CLIPTextModelWithProjection(eqx.Module):
    """The text tower and ``text_projection`` (no bias) to ``projection_dim``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    text_model: CLIPTextModel
    text_projection: Linear

    @classmethod
    def init(
        cls, config: CLIPTextConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> CLIPTextModelWithProjection:
        dtype = _dtype(cls, dtype)
        k_text, k_proj = jax.random.split(key)
        proj = _projection(config.hidden_size, config.projection_dim, dtype, k_proj)
        return cls(CLIPTextModel.init(config, key=k_text, dtype=dtype), proj)

    @property
    def config(self) -> CLIPTextConfig:
        return self.text_model.config

    def __call__(
        self,
        input_ids: Ids,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
    ) -> ProjectionOutput:
        out = self.text_model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=output_hidden_states,
        )
        return ProjectionOutput(
            self.text_projection(out.pooler_output), out.last_hidden_state, out.hidden_states
        )


class CLIPVisionModelWithProjection(eqx.Module):
    """The vision tower and ``visual_projection`` (no bias) to ``projection_dim``."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    vision_model: CLIPVisionModel
    visual_projection: Linear

    @classmethod
    def init(
        cls, config: CLIPVisionConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> CLIPVisionModelWithProjection:
        dtype = _dtype(cls, dtype)
        k_vision, k_proj = jax.random.split(key)
        proj = _projection(config.hidden_size, config.projection_dim, dtype, k_proj)
        return cls(CLIPVisionModel.init(config, key=k_vision, dtype=dtype), proj)

    @property
    def config(self) -> CLIPVisionConfig:
        return self.vision_model.config

    def __call__(
        self, pixel_values: Pixels, *, output_hidden_states: bool = False
    ) -> ProjectionOutput:
        out = self.vision_model(pixel_values, output_hidden_states=output_hidden_states)
        return ProjectionOutput(
            self.visual_projection(out.pooler_output), out.last_hidden_state, out.hidden_states
        )


class CLIPModel(eqx.Module):
    """Both towers, their projections to ``projection_dim`` and the learned temperature
    ``logit_scale`` (a scalar, log of the logits' multiplier)."""

    partition_rules: ClassVar[Rules] = ENCODER_PARTITION_RULES

    text_model: CLIPTextModel
    vision_model: CLIPVisionModel
    visual_projection: Linear
    text_projection: Linear
    logit_scale: Float[Array, ""]
    config: CLIPConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: CLIPConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> CLIPModel:
        """Random towers and projections; ``logit_scale`` at ``logit_scale_init_value``."""
        dtype = _dtype(cls, dtype)
        k_text, k_vision, k_vp, k_tp = jax.random.split(key, 4)
        text, vision, dim = config.text_config, config.vision_config, config.projection_dim
        return cls(
            CLIPTextModel.init(text, key=k_text, dtype=dtype),
            CLIPVisionModel.init(vision, key=k_vision, dtype=dtype),
            _projection(vision.hidden_size, dim, dtype, k_vp),
            _projection(text.hidden_size, dim, dtype, k_tp),
            jnp.asarray(config.logit_scale_init_value, dtype),
            config,
        )

    def get_text_features(
        self,
        input_ids: Ids,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
    ) -> Float[Array, "batch proj"]:
        """The projected pooled text embeddings (not normalised)."""
        out = self.text_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.text_projection(out.pooler_output)

    def get_image_features(self, pixel_values: Pixels) -> Float[Array, "batch proj"]:
        """The projected pooled image embeddings (not normalised)."""
        return self.visual_projection(self.vision_model(pixel_values).pooler_output)

    def __call__(
        self,
        input_ids: Ids,
        pixel_values: Pixels,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
    ) -> CLIPOutput:
        """Every text against every image: scaled cosine similarities."""
        text = self.text_model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=output_hidden_states,
        )
        vision = self.vision_model(pixel_values, output_hidden_states=output_hidden_states)
        text_embeds = l2_normalize(self.text_projection(text.pooler_output))
        image_embeds = l2_normalize(self.visual_projection(vision.pooler_output))
        logits = image_text_logits(text_embeds, image_embeds, self.logit_scale)
        return CLIPOutput(logits.T, logits, text_embeds, image_embeds, text, vision)

    def compute_loss(
        self,
        input_ids: Ids,
        pixel_values: Pixels,
        *,
        attention_mask: Mask | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """CLIP's contrastive loss over a batch of matching (text i, image i) pairs:
        ``(loss, {"loss", "accuracy"})``, accuracy of picking the matching image per text."""
        logits = self(input_ids, pixel_values, attention_mask=attention_mask).logits_per_text
        return _with_metrics(clip_loss(logits), logits)


def _with_metrics(
    loss: Float[Array, ""], logits_per_text: Float[Array, "n n"]
) -> tuple[Float[Array, ""], dict[str, Array]]:
    pairs = jnp.arange(logits_per_text.shape[0], dtype=jnp.int32)
    hits = jnp.argmax(logits_per_text, axis=-1).astype(jnp.int32) == pairs
    return loss, {"loss": loss, "accuracy": jnp.mean(hits.astype(jnp.float32))}
