"""Mixtral (HF ``model_type`` mixtral): Mistral attention with a sparse MoE MLP in every
layer (``num_local_experts`` experts, ``num_experts_per_tok`` of them per token, routing
weights renormalised over the chosen ones).

HF checkpoints store each expert separately (``block_sparse_moe.experts.{e}.w1/w3/w2``:
gate, up, down); the key table stacks them into ``mlp.experts.gate_proj`` / ``up_proj`` /
``down_proj`` ``(layers, experts, ...)`` on load and splits them back on save. The fused
``mlp.experts.gate_up_proj`` / ``down_proj`` of a transformers 5 ``state_dict`` load too.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig
from edl.models.decoder import DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import KeyRule, decoder_key_table

__all__ = [
    "HF_KEYS",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MixtralForSequenceClassification",
    "MixtralModel",
]

# transformers 5 keeps experts fused in memory: gate_up_proj (experts, 2 * intermediate, dim) and
# down_proj (experts, dim, intermediate); save_pretrained writes the per-expert layout again.
FUSED_EXPERT_RULES = (
    KeyRule("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj", "mlp.experts.up_proj"), split=1),
    KeyRule("mlp.experts.down_proj", "mlp.experts.down_proj", load_only=True),
)

HF_KEYS = decoder_key_table(
    (
        ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        ("block_sparse_moe.experts.{expert}.w1.weight", "mlp.experts.gate_proj"),
        ("block_sparse_moe.experts.{expert}.w3.weight", "mlp.experts.up_proj"),
        ("block_sparse_moe.experts.{expert}.w2.weight", "mlp.experts.down_proj"),
        *FUSED_EXPERT_RULES,
    )
)

_READ = {
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "router_z_loss_coef",
}


@dataclasses.dataclass(frozen=True)
class MixtralConfig(DecoderConfig):
    """Mixtral architecture (defaults: transformers' ``MixtralConfig``, Mixtral 8x7B)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("mixtral",)
    ROPE_THETA: ClassVar[float] = 1e6

    model_type: str = "mixtral"
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    num_experts: int = 8
    num_experts_per_tok: int = 2

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> MixtralConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        if c.get("router_jitter_noise"):
            warnings.warn(
                f"config.json: router_jitter_noise={c['router_jitter_noise']} is not applied "
                "(edl routes deterministically); inference is unaffected",
                stacklevel=2,
            )
        fields = cls._common_from_hf(c)
        d = cls._default
        fields.update(
            sliding_window=c.get("sliding_window"),
            num_experts=c.get("num_local_experts", d("num_experts")),
            num_experts_per_tok=c.get("num_experts_per_tok", d("num_experts_per_tok")),
            **cls._router_from_hf(c),
        )
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults(self.GEMMA_FEATURES)
        self._require(
            not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm)
            and len(set(self.layer_windows)) == 1
            and set(self.layer_mlps) == {"moe"}
            and self.norm_topk_prob
            and self.expert_intermediate_size == self.intermediate_size,
            "no biases or q/k norms, one sliding window, every layer MoE with renormalised "
            "top-k weights and experts as wide as intermediate_size",
        )
        out = self._common_to_hf(architectures)
        out.update(
            sliding_window=self.layer_windows[0],
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            **self._router_to_hf(),
        )
        return out


class MixtralModel(DecoderModel):
    """The Mixtral decoder trunk (an MoE MLP in every layer)."""


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral decoder + LM head; ``compute_loss`` adds the router's auxiliary loss."""

    trunk: ClassVar[type[DecoderModel]] = MixtralModel


class MixtralForSequenceClassification(DecoderForSequenceClassification):
    """Mixtral decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = MixtralModel
