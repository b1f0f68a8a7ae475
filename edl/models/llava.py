"""LLaVA (HF ``model_type`` llava): a CLIP or SigLIP vision tower, a two-layer projector
and one of edl's decoders, as transformers (5.x) builds ``LlavaForConditionalGeneration``.

``model.vision_tower`` encodes each image; the hidden states of ``vision_feature_layer``
(without the class token under ``vision_feature_select_strategy="default"``) go through
``model.multi_modal_projector`` into the language model's width and replace, in order, the
``image_token_index`` placeholders of ``input_ids``; ``model.language_model`` (a decoder
trunk of any registered family) and ``lm_head`` do the rest::

    model = edl.from_pretrained("llava-hf/llava-1.5-7b-hf")
    logits = model(input_ids, pixel_values, attention_mask=mask).logits
    loss, metrics = model.compute_loss(input_ids, labels, pixel_values=pixel_values)
    out = edl.generate.generate(model, input_ids, pixel_values=pixel_values)

Files are written as transformers 5 writes them (``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower.*``, ``multi_modal_projector.*``); the
in-memory layout of transformers 5 (``model.language_model.*``) and the older
``vision_tower.vision_model.*`` tower load too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.clip import ENCODER_PARTITION_RULES, CLIPVisionModel, tower_key_table
from edl.models.config import RUN_OPTIONS, DecoderConfig
from edl.models.decoder import PARTITION_RULES, CausalLMOutput, DecoderModel, ModelOutput
from edl.models.encoder_config import CLIPVisionConfig, SiglipVisionConfig, replace_nested
from edl.models.families import family_for
from edl.models.heads import DecoderForCausalLM
from edl.models.keymap import KeyRule, KeyTable
from edl.models.siglip import SiglipVisionModel
from edl.module import require_float_dtype
from edl.nn.attention import KVCacheLike
from edl.nn.layers import Linear
from edl.ops.activations import activation
from edl.ops.checks import error_if
from edl.ops.sharding import Rules

__all__ = [
    "LlavaConfig",
    "LlavaForConditionalGeneration",
    "LlavaModel",
    "LlavaMultiModalProjector",
    "key_table",
    "merge_image_features",
]

Ids = Int[Array, "batch seq"]
Mask = Int[Array, "batch seq"] | jax.Array
Pixels = Float[Array, "images channels height width"]
ImageFeatures = Float[Array, "images tokens dim"]
VisionTower = CLIPVisionModel | SiglipVisionModel
_VISION = {"clip_vision_model": CLIPVisionConfig, "siglip_vision_model": SiglipVisionConfig}
_TOWERS = {CLIPVisionConfig: CLIPVisionModel, SiglipVisionConfig: SiglipVisionModel}
_STRATEGIES = ("default", "full")
# LlavaConfig's own fields, read as they are.
_OWN = frozenset(
    {
        "image_token_index",
        "image_seq_length",
        "projector_hidden_act",
        "vision_feature_select_strategy",
        "vision_feature_layer",
        "multimodal_projector_bias",
        "tie_word_embeddings",
    }
)
_READ = frozenset(
    {
        "model_type",
        "text_config",
        "vision_config",
        "image_token_index",
        "image_token_id",
        "image_seq_length",
        "projector_hidden_act",
        "vision_feature_select_strategy",
        "vision_feature_layer",
        "multimodal_projector_bias",
        "tie_word_embeddings",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
    }
)


@runtime_checkable
class ImageTextConfig(Protocol):
    """What LLaVA's model classes and key tables read of a config: ``LlavaConfig``, or
    ``edl.models.gemma3_vision.Gemma3Config`` (a vision tower, a decoder and a placeholder)."""

    text_config: DecoderConfig
    vision_config: CLIPVisionConfig | SiglipVisionConfig
    image_token_index: int


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    """transformers' ``LlavaConfig``: ``text_config`` (a decoder family's config),
    ``vision_config`` (CLIP's or SigLIP's vision tower) and how they meet."""

    text_config: DecoderConfig
    vision_config: CLIPVisionConfig | SiglipVisionConfig
    image_token_index: int = 32000
    image_seq_length: int = 576
    projector_hidden_act: str = "gelu"
    vision_feature_select_strategy: str = "default"
    vision_feature_layer: int | tuple[int, ...] = -2
    multimodal_projector_bias: bool = True
    tie_word_embeddings: bool = False
    model_type: str = "llava"
    hf_extra: tuple[tuple[str, str], ...] = ()

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llava",)
    # Besides run options (to both models) and the nested configs' own ``SETTINGS``
    # (``edl.models.heads.reconfigure``).
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"hf_extra"})

    def __post_init__(self) -> None:
        if not isinstance(self.text_config, DecoderConfig):
            raise ValueError(f"text_config must be a DecoderConfig, got {self.text_config!r:.80}")
        if type(self.vision_config) not in _TOWERS:
            raise ValueError(
                f"vision_config must be a CLIP or SigLIP vision config, got "
                f"{type(self.vision_config).__name__}"
            )
        if self.vision_feature_select_strategy not in _STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy must be one of {_STRATEGIES}, got "
                f"{self.vision_feature_select_strategy!r}"
            )
        depth = self.vision_config.num_hidden_layers
        for layer in self.feature_layers:
            if not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
                raise ValueError(
                    f"vision_feature_layer {layer!r} must index the vision tower's "
                    f"{depth + 1} hidden states (-{depth + 1} to {depth})"
                )
        if not 0 <= self.image_token_index < self.text_config.vocab_size:
            raise ValueError(
                f"image_token_index {self.image_token_index} must lie in the language model's "
                f"vocabulary [0, {self.text_config.vocab_size})"
            )
        if len(set(self.text_config.layer_groups)) > 1:
            raise ValueError("LLaVA over a decoder with mixed dense / MoE layer stacks")
        activation(self.projector_hidden_act)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layers = self.vision_feature_layer
        return (layers,) if isinstance(layers, int) else tuple(layers)

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (here or in ``text_config``)."""
        return self.tie_word_embeddings or self.text_config.tie_word_embeddings

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image: the tower's tokens (CLIP's class token and one per
        patch), less the first under the ``"default"`` strategy."""
        tokens = self.vision_config.num_patches + isinstance(self.vision_config, CLIPVisionConfig)
        return tokens - (self.vision_feature_select_strategy == "default")

    def replace(self, **changes: Any) -> LlavaConfig:
        """A copy with ``changes``; run options (``scan_layers=False``) go to both models."""
        return replace_nested(self, changes)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> LlavaConfig:
        """Read a HF ``config.json`` dict; ``overrides``: run options for both models."""
        c = dict(config)
        if c.get("model_type") != "llava":
            raise ValueError(f"config.json: model_type {c.get('model_type')!r} is not 'llava'")
        unknown = sorted(set(overrides) - RUN_OPTIONS)
        if unknown:
            raise ValueError(f"LlavaConfig.from_hf: unknown overrides {unknown} (run options only)")
        text, vision = c.get("text_config") or {}, c.get("vision_config") or {}
        if not isinstance(text, Mapping) or not isinstance(vision, Mapping):
            raise ValueError("config.json: text_config and vision_config must be objects")
        text = {"model_type": "llama", **text}
        vision = {"model_type": "clip_vision_model", **vision}
        if vision["model_type"] not in _VISION:
            raise ValueError(
                f"config.json: vision_config.model_type {vision['model_type']!r} is not one of "
                f"{sorted(_VISION)}"
            )
        fields = {k: c[k] for k in _OWN & set(c)}
        if "image_token_id" in c and "image_token_index" not in c:
            fields["image_token_index"] = c["image_token_id"]
        if isinstance(fields.get("vision_feature_layer"), list):
            fields["vision_feature_layer"] = tuple(fields["vision_feature_layer"])
        extra = tuple(sorted((k, json.dumps(v)) for k, v in c.items() if k not in _READ))
        try:
            return cls(
                text_config=family_for(text["model_type"]).config_cls.from_hf(text, **overrides),
                vision_config=_VISION[vision["model_type"]].from_hf(vision, **overrides),
                hf_extra=extra,
                **fields,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json (llava): {e}") from e

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        layer = self.vision_feature_layer
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        out.update(
            model_type="llava",
            text_config=self.text_config.to_hf(),
            vision_config=self.vision_config.to_hf(),
            image_token_index=self.image_token_index,
            image_seq_length=self.image_seq_length,
            projector_hidden_act=self.projector_hidden_act,
            vision_feature_select_strategy=self.vision_feature_select_strategy,
            vision_feature_layer=layer if isinstance(layer, int) else list(layer),
            multimodal_projector_bias=self.multimodal_projector_bias,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if architectures is not None:
            out["architectures"] = list(architectures)
        return out


def key_table(config: ImageTextConfig) -> KeyTable:
    """HF <-> edl keys of a LLaVA model: the language model's own table moved under
    ``language_model.`` (HF) / ``model.language_model.`` (edl), the vision tower's under
    ``vision_tower.`` / ``model.vision_tower.``; the older layouts load only."""
    rules: list[KeyRule | tuple] = [
        *tower_key_table(
            "vision_tower.",
            "model.vision_tower.",
            legacy=(
                "vision_tower.vision_model.",
                "model.vision_tower.vision_model.",
                "model.vision_tower.",
            ),
        ),
        ("model.multi_modal_projector.{name}", "model.multi_modal_projector.{name}", None, True),
        ("multi_modal_projector.{name}", "model.multi_modal_projector.{name}"),
        ("lm_head.weight", "lm_head.weight", None, True),
        ("language_model.lm_head.weight", "lm_head.weight"),
    ]
    for rule in _trunk_rules(config):
        tail = rule.hf.removeprefix("model.language_model.")
        rules.append(dataclasses.replace(rule, load_only=True))
        rules.append(dataclasses.replace(rule, hf="language_model.model." + tail))
    rules += [  # the trunk's other arrays (embed_tokens, norm), after its layer rules
        ("model.language_model.{name}", "model.language_model.{name}", None, True),
        ("language_model.model.{name}", "model.language_model.{name}"),
    ]
    return KeyTable(tuple(rules), ignore_hf=_IGNORED)


_IGNORED = (r"(.*\.)?embeddings\.position_ids", r".*rotary_emb\.inv_freq")


def _trunk_rules(config: ImageTextConfig) -> list[KeyRule]:
    """The language model family's trunk rules (HF ``model.*`` <-> edl ``model.*`` of its
    causal LM) moved to transformers 5's module names, ``model.language_model.*`` both ways."""
    text = family_for(config.text_config.model_type).key_table_for(config.text_config)
    out = []
    for rule in text.rules:
        if not (rule.hf.startswith("model.") and rule.edl_templates[0].startswith("model.")):
            continue
        edl = tuple("model.language_model." + e.removeprefix("model.") for e in rule.edl_templates)
        hf = "model.language_model." + rule.hf.removeprefix("model.")
        out.append(dataclasses.replace(rule, hf=hf, edl=edl[0] if len(edl) == 1 else edl))
    return out


def module_key_table(config: ImageTextConfig) -> KeyTable:
    """The names of transformers 5's modules (``model.language_model.layers.0.self_attn``,
    ``model.vision_tower.encoder.layers.0.mlp``), which PEFT adapters use: edl's paths with
    each layer's index, unlike the files' ``language_model.model.*``."""
    rules = [
        *tower_key_table("model.vision_tower.", "model.vision_tower."),
        *_trunk_rules(config),
        ("model.language_model.{name}", "model.language_model.{name}"),
        ("{name}", "{name}"),
    ]
    return KeyTable(tuple(rules), ignore_hf=_IGNORED)


class LlavaMultiModalProjector(eqx.Module):
    """``linear_2(act(linear_1(features)))``: vision width (times the number of feature
    layers) to the language model's width."""

    linear_1: Linear
    linear_2: Linear
    act: str = eqx.field(static=True, default="gelu")

    @classmethod
    def init(
        cls, config: LlavaConfig, *, dtype: DTypeLike, key: PRNGKeyArray
    ) -> LlavaMultiModalProjector:
        k1, k2 = jax.random.split(key)
        width = config.vision_config.hidden_size * len(config.feature_layers)
        dim, std = config.text_config.hidden_size, config.text_config.initializer_range
        kw = {"use_bias": config.multimodal_projector_bias, "std": std, "dtype": dtype}
        return cls(
            Linear.init(width, dim, key=k1, **kw),
            Linear.init(dim, dim, key=k2, **kw),
            act=config.projector_hidden_act,
        )

    def __call__(self, x: Float[Array, "*batch vision"]) -> Float[Array, "*batch dim"]:
        return self.linear_2(activation(self.act)(self.linear_1(x)))


def merge_image_features(
    inputs_embeds: Float[Array, "batch seq dim"],
    input_ids: Ids,
    image_features: ImageFeatures,
    image_token_index: int,
) -> Float[Array, "batch seq dim"]:
    """``inputs_embeds`` with the ``image_token_index`` positions of ``input_ids`` replaced,
    in row-major order, by the rows of ``image_features`` (transformers' ``masked_scatter``).
    The placeholder count must equal ``images * tokens``: checked eagerly with the counts in
    the message, and inside compiled code (``edl.ops.checks.error_if``)."""
    is_image = input_ids == image_token_index
    want = image_features.shape[0] * image_features.shape[1]
    if not isinstance(is_image, jax.core.Tracer):  # eager (not under jit)
        found = int(np.sum(np.asarray(is_image)))
        if found != want:
            raise ValueError(
                f"input_ids hold {found} image tokens (id {image_token_index}) but "
                f"{image_features.shape[0]} images give {want} features "
                f"({image_features.shape[1]} per image)"
            )
    flat = image_features.reshape(want, -1).astype(inputs_embeds.dtype)
    index = jnp.cumsum(is_image.reshape(-1).astype(jnp.int32)) - 1
    gathered = jnp.take(flat, jnp.clip(index, 0, want - 1), axis=0).reshape(inputs_embeds.shape)
    merged = jnp.where(is_image[..., None], gathered, inputs_embeds)
    count = jnp.sum(is_image.astype(jnp.int32))
    return error_if(merged, count != want, "image token count != images * tokens per image")


class LlavaModel(eqx.Module):
    """The vision tower, the projector and the language model's trunk."""

    partition_rules: ClassVar[Rules] = PARTITION_RULES[:-1] + ENCODER_PARTITION_RULES
    # The projector's class (``init(config, dtype=, key=)``): Gemma 3 has its own.
    projector_cls: ClassVar[type] = LlavaMultiModalProjector

    vision_tower: VisionTower
    multi_modal_projector: LlavaMultiModalProjector
    language_model: DecoderModel
    config: ImageTextConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: ImageTextConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> LlavaModel:
        """Random weights; ``dtype`` must be a floating dtype."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_vision, k_proj, k_text = jax.random.split(key, 3)
        tower = _TOWERS[type(config.vision_config)]
        trunk = family_for(config.text_config.model_type).tasks["base"]
        return cls(
            tower.init(config.vision_config, key=k_vision, dtype=dtype),
            cls.projector_cls.init(config, dtype=dtype, key=k_proj),
            trunk.init(config.text_config, key=k_text, dtype=dtype),
            config,
        )

    def get_image_features(self, pixel_values: Pixels) -> ImageFeatures:
        """Each image's projected features ``(images, tokens, text_dim)``: the tower's
        ``vision_feature_layer`` hidden states (concatenated over several layers), without
        the class token under the ``"default"`` strategy."""
        c = self.config
        hidden = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        # "default" drops the first token: CLIP's class token (and, as transformers does,
        # a SigLIP tower's first patch: SigLIP-based LLaVAs use "full").
        drop = int(c.vision_feature_select_strategy == "default")
        selected = [hidden[layer][:, drop:] for layer in c.feature_layers]
        return self.multi_modal_projector(jnp.concatenate(selected, axis=-1))

    def embed_inputs(self, input_ids: Ids, pixel_values: Pixels | None) -> Float[Array, "b s d"]:
        """Token embeddings with the image placeholders replaced by image features."""
        embeds = self.language_model.embed(input_ids)
        if pixel_values is None:
            return embeds
        features = self.get_image_features(pixel_values)
        return merge_image_features(embeds, input_ids, features, self.config.image_token_index)

    def __call__(
        self,
        input_ids: Ids | None = None,
        pixel_values: Pixels | None = None,
        *,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> ModelOutput:
        """The language model's output on ``input_ids`` with ``pixel_values``' features
        merged in (or on ``inputs_embeds``, already merged); other arguments as
        ``DecoderModel``'s."""
        if input_ids is not None and inputs_embeds is None:
            inputs_embeds = self.embed_inputs(input_ids, pixel_values)
        elif pixel_values is not None:
            raise ValueError("pixel_values need input_ids (their image tokens), not embeddings")
        return self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=output_hidden_states,
            cache=cache,
        )


class LlavaForConditionalGeneration(eqx.Module):
    """``LlavaModel`` + ``lm_head`` (``None`` when tied to the token embedding).

    ``generation_config``: the model's ``generation_config.json`` as sorted (key, JSON) pairs,
    as on the decoders' causal LMs."""

    partition_rules: ClassVar[Rules] = LlavaModel.partition_rules
    base_cls: ClassVar[type] = LlavaModel  # the model under the head (Gemma 3 has its own)

    model: LlavaModel
    lm_head: Linear | None
    generation_config: tuple[tuple[str, str], ...] = eqx.field(static=True, default=())

    @classmethod
    def init(
        cls, config: ImageTextConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> LlavaForConditionalGeneration:
        """Random weights; ``dtype`` must be a floating dtype."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_model, k_head = jax.random.split(key)
        text, head = config.text_config, None
        if not config.tied:
            head = Linear.init(
                text.hidden_size,
                text.vocab_size,
                std=text.initializer_range,
                dtype=dtype,
                key=k_head,
            )
        return cls(cls.base_cls.init(config, key=k_model, dtype=dtype), head)

    @property
    def config(self) -> ImageTextConfig:
        return self.model.config

    def text_lm(self) -> DecoderForCausalLM:
        """The language model with the head as its family's causal LM (the same arrays, no
        copy): what generation runs after the image features are merged in."""
        trunk = self.model.language_model
        lm_class = family_for(trunk.config.model_type).tasks["causal_lm"]
        return lm_class(trunk, self.lm_head, self.generation_config)

    def get_image_features(self, pixel_values: Pixels) -> ImageFeatures:
        """See ``LlavaModel.get_image_features``."""
        return self.model.get_image_features(pixel_values)

    def __call__(
        self,
        input_ids: Ids | None = None,
        pixel_values: Pixels | None = None,
        *,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> CausalLMOutput:
        """Logits ``(batch, seq, vocab)``; inputs as ``LlavaModel``'s."""
        out = self.model(
            input_ids,
            pixel_values,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=output_hidden_states,
            cache=cache,
        )
        return CausalLMOutput(
            self.text_lm().lm_logits(out.last_hidden_state), out.hidden_states, out.cache
        )

    def compute_loss(
        self,
        input_ids: Ids,
        labels: Ids | None = None,
        *,
        pixel_values: Pixels | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        chunk_size: int = 2048,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """Next-token cross entropy on the text (the decoders' ``compute_loss`` on the
        merged embeddings). ``labels`` default to ``input_ids`` with the image tokens
        ignored (-100); given ones are used as they are (HF semantics)."""
        if labels is None:
            labels = jnp.where(input_ids == self.config.image_token_index, -100, input_ids)
        return self.text_lm().compute_loss(
            labels=labels,
            inputs_embeds=self.model.embed_inputs(input_ids, pixel_values),
            attention_mask=attention_mask,
            position_ids=position_ids,
            chunk_size=chunk_size,
        )
