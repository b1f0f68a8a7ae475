"""Qwen3-Next (HF ``model_type`` qwen3_next; Qwen3-Next-80B-A3B and its smaller kin).

A hybrid decoder (``edl.models.qwen3_next_trunk``): ``layer_types`` puts Gated DeltaNet
linear attention (``linear_attention``: a causal conv and the chunked gated delta rule,
``edl.ops.delta_rule``) or gated full attention (``full_attention``: q/k RMSNorm, partial
rotary, default ``partial_rotary_factor`` 0.25, a sigmoid output gate from ``q_proj``) in each
layer, by default three linear layers then a full one (``full_attention_interval`` 4). The
MLPs are high-sparsity MoE (``num_experts`` 512, 10 per token) plus a shared expert behind a
sigmoid ``shared_expert_gate``, dense where ``mlp_only_layers`` / ``decoder_sparse_step``
say (Qwen3-MoE's rule). Every RMSNorm is zero-centred (``1 + w``) but the gated one on the
DeltaNet output. The multi-token-prediction weights (``mtp.*``) are skipped on load, as
transformers does::

    model = edl.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Instruct")

Generation runs with the contiguous or the paged KV cache (``edl.generate(...,
page_size=)``: the full layers' keys / values in pages, the linear layers' states per row)
and in the serving engine (``edl serve``: one recurrent-state slot per running request,
``edl.serve.state_slots``; prefix caching is off for it, since shared pages hold no state).
Packed sequences (``segment_ids``) restart each linear layer's conv and delta states at
every segment. Not supported: speculative decoding (a rejected draft cannot be taken back
out of a recurrent state), refused with an error naming why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import DecoderConfig
from edl.models.flops import attention_score_flops, mlp_flops
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table
from edl.models.mixtral import FUSED_EXPERT_RULES
from edl.models.qwen3_moe import hf_layer_mlps
from edl.models.qwen3_next_trunk import FULL, LINEAR, QWEN3_NEXT_RULES, Qwen3NextTrunk
from edl.ops.rope import RopeConfig

__all__ = [
    "HF_KEYS",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    "Qwen3NextForSequenceClassification",
    "Qwen3NextModel",
]

HF_KEYS = decoder_key_table(
    (
        ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.gate_proj"),
        ("mlp.experts.{expert}.up_proj.weight", "mlp.experts.up_proj"),
        ("mlp.experts.{expert}.down_proj.weight", "mlp.experts.down_proj"),
        *FUSED_EXPERT_RULES,
    ),
    ignore_hf=(r"mtp\..*",),  # multi-token prediction: transformers skips it too
)

_LINEAR_KEYS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
_READ = {
    *_LINEAR_KEYS,
    "attention_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "layer_types",
    "full_attention_interval",
}
_PARTIAL_ROTARY = 0.25  # transformers' default for this family
_INTERVAL = 4  # transformers' default full_attention_interval


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig):
    """Qwen3-Next architecture (defaults: transformers' ``Qwen3NextConfig``).
    ``layer_types`` ``None``: a full-attention layer every fourth."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_next",)

    model_type: str = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    max_position_embeddings: int = 32768
    qk_norm: bool = True
    norm_offset: float = 1.0  # every Qwen3NextRMSNorm is (1 + w)
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int | None = 512
    norm_topk_prob: bool = True
    layer_types: tuple[str, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    shared_expert_intermediate_size: int = 512

    def __post_init__(self) -> None:
        if self.layer_types is None:
            kinds = tuple(
                FULL if (i + 1) % _INTERVAL == 0 else LINEAR for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", kinds)
        elif isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        self._check_per_layer("layer_types", self.layer_types)
        if set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(
                f"layer_types entries must be {LINEAR!r} or {FULL!r}, got {self.layer_types}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if any(w is not None for w in self.layer_windows):
            raise ValueError("qwen3_next has no sliding-window layers")

    def _default_rope(self) -> RopeConfig:
        return RopeConfig(dim=int(self.head_dim * _PARTIAL_ROTARY), theta=self.ROPE_THETA)

    @property
    def layer_settings(self) -> tuple:
        """Full layers ``(None, rope)``; linear ones ``(None, None)`` (no RoPE)."""
        return tuple((None, self.rope if t == FULL else None) for t in self.layer_types)

    @property
    def layer_groups(self) -> tuple[str, ...]:
        """Each layer's stack: ``layers`` (linear attention) or ``attn_layers`` (full), with
        a ``dense_`` prefix for the dense-MLP ones when dense and MoE layers mix."""
        mixed = len(set(self.layer_mlps)) > 1
        out = []
        for kind, mlp in zip(self.layer_types, self.layer_mlps, strict=True):
            name = "layers" if kind == LINEAR else "attn_layers"
            out.append(f"dense_{name}" if mixed and mlp == "dense" else name)
        return tuple(out)

    def layer_flops(self, index: int, seq_len: int) -> float:
        """A full layer: gated attention (``q_proj`` also makes the output gate); a linear
        one: ``in_proj_qkvz``, ``in_proj_ba``, ``out_proj`` and the delta rule counted as
        its recurrent form (per value head and token: ``k^T S``, the rank-1 update and
        ``q^T S``, ``key_dim x value_dim`` multiply-accumulates each). MoE layers add the
        shared expert and its gate."""
        d = self.hidden_size
        if self.layer_types[index] == FULL:
            heads, kv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
            projections = d * 2 * heads * hd + 2 * d * kv * hd + heads * hd * d
            mixer = 2.0 * projections + attention_score_flops(heads, hd, hd, None, seq_len)
        else:
            keys = self.linear_num_key_heads * self.linear_key_head_dim
            values = self.linear_num_value_heads * self.linear_value_head_dim
            projections = d * (2 * keys + 2 * values) + d * 2 * self.linear_num_value_heads
            projections += values * d
            recurrence = 3 * self.linear_num_value_heads * self.linear_key_head_dim
            mixer = 2.0 * (projections + recurrence * self.linear_value_head_dim)
        kind = self.layer_mlps[index]
        shared = 3 * d * self.shared_expert_intermediate_size + d if kind == "moe" else 0
        return mixer + mlp_flops(self, kind, shared=shared)

    @property
    def kv_cache_layers(self) -> int:
        """The layers a KV cache holds keys / values for: the full-attention ones."""
        return self.layer_types.count(FULL)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> Qwen3NextConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        rope_params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        if "partial_rotary_factor" not in c and "partial_rotary_factor" not in rope_params:
            c["partial_rotary_factor"] = _PARTIAL_ROTARY
        fields = cls._common_from_hf(c)
        d = cls._default
        n = fields["num_hidden_layers"]
        experts = c.get("num_experts", d("num_experts"))
        interval = c.get("full_attention_interval", _INTERVAL)
        kinds = c.get("layer_types") or [
            FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)
        ]
        bias = bool(c.get("attention_bias", False))
        fields.update(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            norm_offset=1.0,
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", d("num_experts_per_tok")),
            moe_intermediate_size=c.get("moe_intermediate_size", d("moe_intermediate_size")),
            shared_expert_intermediate_size=c.get(
                "shared_expert_intermediate_size", d("shared_expert_intermediate_size")
            ),
            norm_topk_prob=bool(c.get("norm_topk_prob", d("norm_topk_prob"))),
            layer_mlps=hf_layer_mlps(c, n, experts),
            layer_types=tuple(kinds),
            **{k: c.get(k, d(k)) for k in _LINEAR_KEYS},
            **cls._router_from_hf(c),
        )
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults(tuple(f for f in self.GEMMA_FEATURES if f != "norm_offset"))
        self._require(
            self.qk_norm and self.norm_offset == 1.0 and self.qkv_bias == self.o_bias,
            "q/k norms, (1 + w) norms and one attention bias",
        )
        self._require(not self.mlp_bias, "an MLP bias")
        out = self._common_to_hf(architectures)
        partial = self.rope.dim / self.head_dim  # written even when 1: HF's default is 0.25
        out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": partial}
        out.update(
            partial_rotary_factor=partial,
            attention_bias=self.qkv_bias,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.expert_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, m in enumerate(self.layer_mlps) if m == "dense"],
            layer_types=list(self.layer_types),
            **{k: getattr(self, k) for k in _LINEAR_KEYS},
            **self._router_to_hf(),
        )
        out.pop("full_attention_interval", None)  # layer_types says it
        return out


class Qwen3NextModel(Qwen3NextTrunk):
    """The Qwen3-Next decoder trunk."""


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next decoder + LM head; ``compute_loss`` adds the router's auxiliary loss."""

    trunk: ClassVar[type] = Qwen3NextModel
    partition_rules: ClassVar = QWEN3_NEXT_RULES


class Qwen3NextForSequenceClassification(DecoderForSequenceClassification):
    """Qwen3-Next decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type] = Qwen3NextModel
    partition_rules: ClassVar = QWEN3_NEXT_RULES
