"""Gemma 3's multimodal model (HF ``model_type`` gemma3, ``Gemma3ForConditionalGeneration``):
a SigLIP tower, Gemma 3's projector and the Gemma 3 text decoder, through LLaVA's code.

What differs from LLaVA (``edl.models.llava``), as transformers 5 builds it:

- Image features: the tower's ``last_hidden_state`` (after ``post_layernorm``) goes through
  ``Gemma3MultiModalProjector``: the patch grid average-pooled to ``mm_tokens_per_image``
  tokens, a Gemma RMSNorm (``1 + w``, the tower's ``layer_norm_eps``) and a matmul by
  ``mm_input_projection_weight`` ``(vision_dim, text_dim)``.
- The placeholders (``image_token_index``) are embedded and scaled as every Gemma token is,
  then replaced by the features (LLaVA's ``merge_image_features``); ``boi_token_index`` /
  ``eoi_token_index`` are ordinary tokens the processor puts around them.
- ``token_type_ids`` (1 on image tokens, as the processor returns them): the tokens of one
  image attend to each other both ways (``edl.ops.block_attention``); without them the
  mask is causal, as in transformers. ``generate`` derives them from the prompt's
  placeholders (transformers' prefill with the processor's ``token_type_ids``) and decodes
  causally.
- Files and PEFT module names are LLaVA's (``language_model.model.*``,
  ``vision_tower.*``, ``multi_modal_projector.*``; the released checkpoints'
  ``vision_tower.vision_model.*`` loads too): ``edl.models.llava.key_table``.

Not supported: a text config other than ``gemma3_text``, an ``image_token_index`` outside the
vocabulary (transformers swaps it for id 0 before embedding), and pan-and-scan crops beyond
what the image processor gives as separate images.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.config import RUN_OPTIONS
from edl.models.decoder import CausalLMOutput, ModelOutput
from edl.models.encoder_config import SiglipVisionConfig, replace_nested
from edl.models.gemma3 import Gemma3TextConfig
from edl.models.llava import (
    Ids,
    ImageFeatures,
    LlavaForConditionalGeneration,
    LlavaModel,
    Mask,
    Pixels,
)
from edl.nn.attention import KVCacheLike
from edl.nn.layers import RMSNorm
from edl.ops.block_attention import block_ids
from edl.ops.checks import check_ids
from edl.ops.losses import causal_lm_loss, mask_without_context

__all__ = [
    "Gemma3Config",
    "Gemma3ForConditionalGeneration",
    "Gemma3Model",
    "Gemma3MultiModalProjector",
]

_OWN = frozenset(
    {
        "mm_tokens_per_image",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "initializer_range",
        "tie_word_embeddings",
    }
)
_ALIASES = {
    "image_token_id": "image_token_index",
    "boi_token_id": "boi_token_index",
    "eoi_token_id": "eoi_token_index",
}
_READ = (
    _OWN
    | set(_ALIASES)
    | {
        "model_type",
        "text_config",
        "vision_config",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
    }
)


def _gemma3_tower() -> SiglipVisionConfig:
    """gemma-3-4b's SigLIP tower (transformers' bare default tower, 14 patches a side, does
    not pool to 256 tokens)."""
    return SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    )


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """transformers' ``Gemma3Config``: ``text_config`` (``Gemma3TextConfig``),
    ``vision_config`` (SigLIP's tower; default gemma-3-4b's) and how they meet (defaults:
    transformers')."""

    text_config: Gemma3TextConfig = dataclasses.field(default_factory=Gemma3TextConfig)
    vision_config: SiglipVisionConfig = dataclasses.field(default_factory=_gemma3_tower)
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255_999
    eoi_token_index: int = 256_000
    image_token_index: int = 262_144
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    model_type: str = "gemma3"
    hf_extra: tuple[tuple[str, str], ...] = ()

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma3",)
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"hf_extra"})
    # generate's prefill: each image's tokens attend to each other both ways.
    BIDIRECTIONAL_IMAGES: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.text_config, Gemma3TextConfig):
            raise ValueError(
                f"text_config must be a Gemma3TextConfig, got {type(self.text_config).__name__}"
            )
        if not isinstance(self.vision_config, SiglipVisionConfig):
            raise ValueError(
                f"vision_config must be a SiglipVisionConfig, got "
                f"{type(self.vision_config).__name__}"
            )
        side = math.isqrt(self.mm_tokens_per_image)
        patches = self.patches_per_side
        if side * side != self.mm_tokens_per_image or side == 0 or patches % side:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side "
                f"divides the tower's {patches} patches per side (image_size / patch_size)"
            )
        if not 0 <= self.image_token_index < self.text_config.vocab_size:
            raise ValueError(
                f"image_token_index {self.image_token_index} must lie in the language model's "
                f"vocabulary [0, {self.text_config.vocab_size})"
            )

    @property
    def patches_per_side(self) -> int:
        return self.vision_config.image_size // self.vision_config.patch_size

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (here or in ``text_config``)."""
        return self.tie_word_embeddings or self.text_config.tie_word_embeddings

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image."""
        return self.mm_tokens_per_image

    def replace(self, **changes: Any) -> Gemma3Config:
        """A copy with ``changes``; run options (``scan_layers=False``) go to both models."""
        return replace_nested(self, changes)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> Gemma3Config:
        """Read a HF ``config.json`` dict; ``overrides``: run options for both models."""
        c = dict(config)
        if c.get("model_type") != "gemma3":
            raise ValueError(f"config.json: model_type {c.get('model_type')!r} is not 'gemma3'")
        unknown = sorted(set(overrides) - RUN_OPTIONS)
        if unknown:
            raise ValueError(
                f"Gemma3Config.from_hf: unknown overrides {unknown} (run options only)"
            )
        text, vision = c.get("text_config") or {}, c.get("vision_config") or {}
        if not isinstance(text, Mapping) or not isinstance(vision, Mapping):
            raise ValueError("config.json: text_config and vision_config must be objects")
        text = {"model_type": "gemma3_text", **text}
        vision = {"model_type": "siglip_vision_model", **vision}
        for name, value, want in (
            ("text_config", text, "gemma3_text"),
            ("vision_config", vision, "siglip_vision_model"),
        ):
            if value["model_type"] != want:
                raise ValueError(
                    f"config.json: {name}.model_type {value['model_type']!r} is not {want!r} "
                    "(Gemma 3's multimodal model)"
                )
        extra = tuple(sorted((k, json.dumps(v)) for k, v in c.items() if k not in _READ))
        fields = {k: c[k] for k in _OWN & set(c)}
        for alias, name in _ALIASES.items():  # transformers' attribute_map
            if alias in c and name not in c:
                fields[name] = c[alias]
        try:
            return cls(
                text_config=Gemma3TextConfig.from_hf(text, **overrides),
                vision_config=SiglipVisionConfig.from_hf(vision, **overrides),
                hf_extra=extra,
                **fields,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json (gemma3): {e}") from e

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        out.update(
            model_type="gemma3",
            text_config=self.text_config.to_hf(),
            vision_config=self.vision_config.to_hf(),
            **{k: getattr(self, k) for k in sorted(_OWN)},
        )
        if architectures is not None:
            out["architectures"] = list(architectures)
        return out


class Gemma3MultiModalProjector(eqx.Module):
    """Average pooling of the patch grid to ``tokens_per_side ** 2`` tokens, a Gemma RMSNorm
    and ``mm_input_projection_weight`` ``(vision_dim, text_dim)`` (transformers'
    ``Gemma3MultiModalProjector``)."""

    mm_input_projection_weight: Float[Array, "vision dim"]
    mm_soft_emb_norm: RMSNorm
    patches_per_side: int = eqx.field(static=True)
    tokens_per_side: int = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: Gemma3Config, *, dtype: DTypeLike, key: PRNGKeyArray
    ) -> Gemma3MultiModalProjector:
        """Zero projection and a unit norm, as transformers initialises them."""
        del key
        vision = config.vision_config
        weight = jnp.zeros((vision.hidden_size, config.text_config.hidden_size), dtype)
        norm = RMSNorm.init(vision.hidden_size, eps=vision.layer_norm_eps, offset=1.0, dtype=dtype)
        side = math.isqrt(config.mm_tokens_per_image)
        return cls(weight, norm, config.patches_per_side, side)

    def __call__(self, x: Float[Array, "images patches vision"]) -> Float[Array, "images t dim"]:
        images, _, width = x.shape
        p, t = self.patches_per_side, self.tokens_per_side
        k = p // t  # the pooling kernel and stride
        # Patches are row-major over the grid: (row, col) -> (t, k, t, k) windows.
        grid = x.reshape(images, t, k, t, k, width)
        pooled = jnp.mean(grid.astype(jnp.float32), axis=(2, 4)).astype(x.dtype)
        normed = self.mm_soft_emb_norm(pooled.reshape(images, t * t, width))
        return jnp.matmul(normed, self.mm_input_projection_weight).astype(x.dtype)


def _blocks(token_type_ids: Ids | None) -> Ids | None:
    return None if token_type_ids is None else block_ids(jnp.asarray(token_type_ids))


class Gemma3Model(LlavaModel):
    """The SigLIP tower, Gemma 3's projector and the Gemma 3 text trunk."""

    projector_cls: ClassVar[type] = Gemma3MultiModalProjector

    def get_image_features(self, pixel_values: Pixels) -> ImageFeatures:
        """Each image's projected features ``(images, mm_tokens_per_image, text_dim)``."""
        hidden = self.vision_tower(pixel_values).last_hidden_state
        return self.multi_modal_projector(hidden)

    def __call__(
        self,
        input_ids: Ids | None = None,
        pixel_values: Pixels | None = None,
        *,
        token_type_ids: Ids | None = None,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> ModelOutput:
        """``LlavaModel``'s call; ``token_type_ids`` (1 on image tokens) open each image's
        tokens to each other both ways (module docstring)."""
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
            blocks=_blocks(token_type_ids),
        )


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    """``Gemma3Model`` + ``lm_head`` (``None`` when tied to the token embedding, the
    released checkpoints' case)."""

    base_cls: ClassVar[type] = Gemma3Model

    def __call__(
        self,
        input_ids: Ids | None = None,
        pixel_values: Pixels | None = None,
        *,
        token_type_ids: Ids | None = None,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> CausalLMOutput:
        """Logits ``(batch, seq, vocab)``; inputs as ``Gemma3Model``'s."""
        out = self.model(
            input_ids,
            pixel_values,
            token_type_ids=token_type_ids,
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
        token_type_ids: Ids | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        chunk_size: int = 2048,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """Next-token cross entropy on the text, as ``LlavaForConditionalGeneration``'s
        (labels default to ``input_ids`` with the image tokens ignored), with
        ``token_type_ids``' bidirectional images."""
        lm = self.text_lm()
        if labels is None:
            labels = jnp.where(input_ids == self.config.image_token_index, -100, input_ids)
        elif lm.config.run.check_inputs:
            labels = check_ids(labels, lm.config.vocab_size, name="labels", ignore=-100)
        labels = mask_without_context(labels, attention_mask=attention_mask)
        out = self.model(
            input_ids,
            pixel_values,
            token_type_ids=token_type_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        return causal_lm_loss(
            out.last_hidden_state,
            lm.head_weight,
            labels,
            attention_mask=attention_mask,
            chunk_size=chunk_size,
            softcap=lm.config.final_softcap,
        )
