"""Qwen3-MoE (HF ``model_type`` qwen3_moe): Qwen3 attention (q/k RMSNorm) with sparse MoE
MLPs (``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok``
per token, renormalised with ``norm_topk_prob``).

HF puts an MoE MLP in layer ``i`` unless ``i`` is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; those layers get a dense MLP of width
``intermediate_size``. edl keeps the dense ones in a second stack (``model.dense_layers``)
when both kinds occur; a repeating pattern still runs as one scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig
from edl.models.decoder import DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table
from edl.models.mixtral import FUSED_EXPERT_RULES

__all__ = [
    "HF_KEYS",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeForSequenceClassification",
    "Qwen3MoeModel",
]

HF_KEYS = decoder_key_table(
    (
        ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.gate_proj"),
        ("mlp.experts.{expert}.up_proj.weight", "mlp.experts.up_proj"),
        ("mlp.experts.{expert}.down_proj.weight", "mlp.experts.down_proj"),
        *FUSED_EXPERT_RULES,
    )
)

_READ = {
    "attention_bias",
    "use_sliding_window",
    "sliding_window",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "max_window_layers",
}


def hf_layer_mlps(c: Mapping[str, Any], n_layers: int, num_experts: int) -> tuple[str, ...]:
    """HF's rule for which Qwen3-MoE layers are sparse."""
    step = c.get("decoder_sparse_step", 1) or 1
    dense = set(c.get("mlp_only_layers") or [])
    return tuple(
        "moe" if i not in dense and num_experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(n_layers)
    )


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE architecture (defaults: transformers' ``Qwen3MoeConfig``)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_moe",)

    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    qk_norm: bool = True
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = 768
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> Qwen3MoeConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        fields = cls._common_from_hf(c)
        d = cls._default
        # transformers 5 writes num_local_experts for this family's num_experts.
        experts = c.get("num_experts", c.get("num_local_experts", d("num_experts")))
        bias = bool(c.get("attention_bias", False))
        window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
        fields.update(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            sliding_window=window,
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", d("num_experts_per_tok")),
            moe_intermediate_size=c.get("moe_intermediate_size", d("moe_intermediate_size")),
            norm_topk_prob=bool(c.get("norm_topk_prob", d("norm_topk_prob"))),
            layer_mlps=hf_layer_mlps(c, fields["num_hidden_layers"], experts),
            **cls._router_from_hf(c),
        )
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults(self.GEMMA_FEATURES)
        self._require(
            self.qk_norm
            and self.qkv_bias == self.o_bias
            and not self.mlp_bias
            and len(set(self.layer_windows)) == 1,
            "q/k norms, one attention bias, no MLP bias and one sliding window for all layers",
        )
        out = self._common_to_hf(architectures)
        window = self.layer_windows[0]
        out.update(
            attention_bias=self.qkv_bias,
            use_sliding_window=window is not None,
            sliding_window=window,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, m in enumerate(self.layer_mlps) if m == "dense"],
            **self._router_to_hf(),
        )
        return out


class Qwen3MoeModel(DecoderModel):
    """The Qwen3-MoE decoder trunk."""


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE decoder + LM head; ``compute_loss`` adds the router's auxiliary loss."""

    trunk: ClassVar[type[DecoderModel]] = Qwen3MoeModel


class Qwen3MoeForSequenceClassification(DecoderForSequenceClassification):
    """Qwen3-MoE decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = Qwen3MoeModel
