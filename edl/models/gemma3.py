"""Gemma 3's text model (HF ``model_type`` gemma3_text).

Gemma 2's decoder (``1 + w`` norms, scaled embeddings, sandwich norms, GeGLU, the attention
scale ``query_pre_attn_scalar ** -0.5``) with q/k RMSNorms per head (``1 + w`` too), final
soft-capping only where the file sets it, and five sliding-window layers to each global
one (``layer_types``; a 26-layer model scans four periods of six layers, then a tail of
two). The sliding layers
rotate with their own base (``rope_local_base_freq``, 10k; transformers 5's
``rope_parameters["sliding_attention"]``: ``sliding_rope``), the global ones with
``rope_theta`` (1M) and the checkpoint's ``rope_scaling`` (linear, factor 8, for 4B and up).

``attn_logit_softcapping`` is read and written back but, as in transformers (whose Gemma 3
attention never passes it on), not applied. HF names the causal LM ``Gemma3ForCausalLM``
and the others ``Gemma3Text...``; the multimodal ``gemma3`` (a SigLIP tower) is not
supported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.decoder import DecoderModel
from edl.models.gemma import HF_KEYS, Gemma2Config
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.rope_config import ropes_from_hf, ropes_to_hf
from edl.ops.rope import RopeConfig

__all__ = [
    "ARCHITECTURES",
    "HF_KEYS",
    "Gemma3ForCausalLM",
    "Gemma3TextConfig",
    "Gemma3TextForSequenceClassification",
    "Gemma3TextModel",
]

LOCAL_THETA = 10000.0  # HF's default rope_local_base_freq


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig(Gemma2Config):
    """Gemma 3 text architecture (defaults: transformers' ``Gemma3TextConfig``, Gemma 3 1B's
    shape but 2B-sized). ``layer_windows`` defaults to a global layer every sixth;
    ``sliding_rope`` to RoPE base ``rope_local_base_freq`` = 10k."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma3_text",)
    ROPE_THETA: ClassVar[float] = 1000000.0
    QK_NORM: ClassVar[bool] = True
    WRITES: ClassVar[frozenset[str]] = frozenset({"sliding_rope"})
    PATTERN: ClassVar[int] = 6  # HF's default sliding_window_pattern

    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    qk_norm: bool = True
    attn_softcap: float | None = None
    final_softcap: float | None = None

    # transformers' Gemma 3 stores attn_logit_softcapping but never applies it: edl keeps
    # the key uninterpreted (in hf_extra, written back as read) and caps nothing.
    _READ: ClassVar[frozenset[str]] = (
        Gemma2Config._READ
        | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
    ) - {"attn_logit_softcapping"}

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        return tuple(
            None if (i + 1) % self.PATTERN == 0 else self.sliding_window
            for i in range(self.num_hidden_layers)
        )

    def _default_sliding_rope(self) -> RopeConfig:
        return RopeConfig(dim=self.head_dim, theta=LOCAL_THETA)

    @classmethod
    def _hf_default_layer_types(cls, c: Mapping[str, Any], n: int) -> list[str]:
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", cls.PATTERN))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(
                f"config.json: sliding_window_pattern must be a positive integer, got {pattern!r}"
            )
        kinds = ("sliding_attention", "full_attention")
        return [kinds[(i + 1) % pattern == 0] for i in range(n)]

    @classmethod
    def _family_from_hf(cls, c: Mapping[str, Any], fields: dict) -> dict:
        out = super()._family_from_hf(c, fields)
        local = c.get("rope_local_base_freq", LOCAL_THETA)
        rope, sliding = ropes_from_hf(
            c, fields["head_dim"], full_theta=cls.ROPE_THETA, sliding_theta=local
        )
        out.update(qk_norm=True, rope=rope, sliding_rope=sliding, attn_softcap=None)
        return out

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers (4 and 5) loads as the same model."""
        self._require(
            self.attn_softcap is None, "attention soft-capping (HF's Gemma 3 applies none)"
        )
        out = super().to_hf(architectures)
        # What the file said, unapplied (see _READ).
        out["attn_logit_softcapping"] = json.loads(
            dict(self.hf_extra).get("attn_logit_softcapping", "null")
        )
        sliding = self.sliding_rope or self.rope
        self._require(
            sliding.rope_type == "default" and sliding.dim == self.rope.dim,
            "the sliding layers' RoPE must be a plain one over the same dims",
        )
        out.update(ropes_to_hf(self.rope, sliding, self.head_dim))
        out["rope_local_base_freq"] = sliding.theta  # transformers 4's spelling
        return out


class Gemma3TextModel(DecoderModel):
    """The Gemma 3 text decoder trunk (per-head q/k norms, two RoPE bases)."""


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text decoder + LM head (tied to the embedding unless the config unties it)."""

    trunk: ClassVar[type[DecoderModel]] = Gemma3TextModel


class Gemma3TextForSequenceClassification(DecoderForSequenceClassification):
    """Gemma 3 text decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Gemma3TextModel


# HF's class per task (not the "<prefix><suffix>" of the other families).
ARCHITECTURES = {
    "causal_lm": "Gemma3ForCausalLM",
    "sequence_classification": "Gemma3TextForSequenceClassification",
    "base": "Gemma3TextModel",
}
