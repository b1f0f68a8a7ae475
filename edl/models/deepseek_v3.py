"""DeepSeek-V3 (HF ``model_type`` deepseek_v3; also Moonlight's checkpoints, and Kimi K2's
under their own ``model_type`` kimi_k2, the same architecture).

Each layer has multi-head latent attention (``edl.nn.mla``: low-rank q and kv, a decoupled
RoPE key shared by the heads, interleaved RoPE pairs, YaRN with ``mscale_all_dim`` on the
softmax scale) and, after the first ``first_k_dense_replace`` dense layers, an MoE MLP
(``edl.nn.grouped_moe``: sigmoid scores, ``e_score_correction_bias`` for the choice only,
grouped top-k over ``n_group`` groups keeping ``topk_group``, ``routed_scaling_factor``,
``norm_topk_prob``) plus ``n_shared_experts`` shared experts. The dense prefix and the MoE
layers are two stacks (``model.dense_layers``, ``model.layers``), each one scan.

Through a cache, MLA keeps the compressed latent: ``edl.generate.init_cache`` of this config
(and the paged cache) holds one KV head of ``kv_lora_rank + qk_rope_head_dim`` features per
token (``latent_cache_dim``), read absorbed. ``mla_cache="materialised"`` (an edl setting,
never written to ``config.json``) caches per-head keys / values instead, for comparison.

Refused by name: FP8 block-quantised checkpoints (``quantization_config``), routing other
than DeepSeek-V3's (``scoring_func`` other than sigmoid, ``topk_method`` other than
``noaux_tc``, ``moe_layer_freq`` other than 1). Multi-token-prediction layers
(``num_nextn_predict_layers``: HF layers ``num_hidden_layers ...``) are skipped on load with
a warning; the base model runs without them, as in transformers.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray

from edl.models.config import DecoderConfig
from edl.models.decoder import PARTITION_RULES, DecoderLayer, DecoderModel, _norm
from edl.models.flops import attention_score_flops, mlp_flops
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import KeyRule, KeyTable, decoder_key_table
from edl.models.mixtral import FUSED_EXPERT_RULES
from edl.nn.grouped_moe import GroupedMoE
from edl.nn.mla import MultiHeadLatentAttention
from edl.nn.mlp import GatedMLP
from edl.ops.mla import yarn_softmax_mscale

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3DecoderLayer",
    "DeepseekV3ForCausalLM",
    "DeepseekV3ForSequenceClassification",
    "DeepseekV3Model",
    "key_table",
]

_LAYER_RULES: tuple[KeyRule | tuple, ...] = (
    ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.gate_proj"),
    ("mlp.experts.{expert}.up_proj.weight", "mlp.experts.up_proj"),
    ("mlp.experts.{expert}.down_proj.weight", "mlp.experts.down_proj"),
    *FUSED_EXPERT_RULES,
)
HF_KEYS = decoder_key_table(_LAYER_RULES)

_READ = {
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
    "n_shared_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "norm_topk_prob",
    "rope_interleave",
    "attention_bias",
    "num_nextn_predict_layers",
    "num_mtp_layers",
}

# Routing settings of other DeepSeek generations (V2's softmax / greedy top-k) that share
# config keys: edl implements V3's and refuses the rest by name.
_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
MLA_CACHES = ("latent", "materialised")


def _check_supported(c: Mapping[str, Any]) -> None:
    if c.get("quantization_config") is not None:
        q = c["quantization_config"]
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise ValueError(
            f"config.json: quantization_config ({method!r}, e.g. DeepSeek-V3's FP8 block-"
            "quantised weights) is not supported: convert the checkpoint to bfloat16 first"
        )
    for key, want in _ROUTING.items():
        if key in c and c[key] != want:
            raise ValueError(
                f"config.json: {key}={c[key]!r} is not supported; deepseek_v3 in edl routes as "
                f"DeepSeek-V3 does ({key}={want!r})"
            )


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3 architecture (defaults: transformers' ``DeepseekV3Config``, the 671B
    model). ``head_dim`` is ``qk_rope_head_dim`` (HF's, the RoPE width); ``layer_mlps``
    dense for the first ``first_k_dense_replace`` layers; ``attn_scale``
    ``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared."""

    # Kimi K2 writes its own model_type for the same architecture (its model card).
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("deepseek_v3", "kimi_k2")
    SETTINGS: ClassVar[frozenset[str]] = DecoderConfig.SETTINGS | {"mla_cache"}

    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    rms_norm_eps: float = 1e-6
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = 2048
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1  # HF's default: not loaded (module docstring)
    mla_cache: str = "latent"  # edl's: what a cache holds (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mla_cache not in MLA_CACHES:
            raise ValueError(f"mla_cache must be one of {MLA_CACHES}, got {self.mla_cache!r}")
        if self.rope.dim != self.qk_rope_head_dim:
            raise ValueError(
                f"rope.dim {self.rope.dim} must equal qk_rope_head_dim {self.qk_rope_head_dim}"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                "MLA expands the latent into every head: num_key_value_heads "
                f"{self.num_key_value_heads} must equal num_attention_heads"
            )

    def _default_head_dim(self) -> int:
        return self.qk_rope_head_dim

    def _default_layer_mlps(self) -> tuple[str, ...]:
        k = self.first_k_dense_replace
        return tuple(
            "dense" if i < k or not self.num_experts else "moe"
            for i in range(self.num_hidden_layers)
        )

    def _default_attn_scale(self) -> float:
        rope = self.rope
        mscale = 1.0
        if rope.rope_type != "default" and rope.mscale_all_dim:
            mscale = yarn_softmax_mscale(rope.factor, rope.mscale_all_dim)
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * mscale

    def layer_flops(self, index: int, seq_len: int) -> float:
        """MLA's projections (low-rank q when ``q_lora_rank``; the kv latent and its
        decoupled RoPE key; the per-head up-projection; o), attention with ``qk_head_dim``
        keys and ``v_head_dim`` values (the training form, per head), and a dense or MoE MLP
        with ``n_shared_experts`` shared experts."""
        d, heads = self.hidden_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank * heads * qk
        else:
            q = d * heads * qk
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        projections = 2.0 * (q + kv + heads * self.v_head_dim * d)
        scores = attention_score_flops(heads, qk, self.v_head_dim, None, seq_len)
        shared = self.n_shared_experts * 3 * d * self.expert_intermediate_size
        return projections + scores + mlp_flops(self, self.layer_mlps[index], shared=shared)

    @property
    def latent_cache_dim(self) -> int | None:
        """Features per token a latent cache holds (``None`` with ``mla_cache="materialised"``)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla_cache == "latent" else None

    @property
    def cache_geometry(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` of a cache (``edl.generate.cache.cache_dims``):
        one latent head, or every head's keys (values padded to the q/k head dim)."""
        if self.latent_cache_dim is not None:
            return self.num_hidden_layers, 1, self.latent_cache_dim
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.num_hidden_layers, self.num_attention_heads, qk

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> DeepseekV3Config:
        """Read a HF ``config.json`` dict (DeepSeek-V3, Kimi K2, Moonlight); ``overrides``
        set edl fields."""
        c = dict(config)
        cls._check_model_type(c)
        _check_supported(c)
        d = cls._default
        rope_dim = c.get("qk_rope_head_dim", d("qk_rope_head_dim"))
        fields = cls._common_from_hf({**c, "head_dim": rope_dim})
        experts = c.get("n_routed_experts", c.get("num_local_experts", d("num_experts")))
        mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
        if mtp:
            warnings.warn(
                f"config.json: num_nextn_predict_layers={mtp}: the multi-token-prediction "
                f"layers (model.layers.{fields['num_hidden_layers']}.* on) are not loaded; "
                "edl runs the base model, as transformers does",
                stacklevel=2,
            )
        fields.update(
            num_key_value_heads=fields["num_attention_heads"],
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", d("num_experts_per_tok")),
            moe_intermediate_size=c.get("moe_intermediate_size", d("moe_intermediate_size")),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            q_lora_rank=c.get("q_lora_rank", d("q_lora_rank")),
            kv_lora_rank=c.get("kv_lora_rank", d("kv_lora_rank")),
            qk_nope_head_dim=c.get("qk_nope_head_dim", d("qk_nope_head_dim")),
            qk_rope_head_dim=rope_dim,
            v_head_dim=c.get("v_head_dim", d("v_head_dim")),
            n_shared_experts=c.get("n_shared_experts") or 0,
            n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=c.get("first_k_dense_replace") or 0,
            rope_interleave=bool(c.get("rope_interleave", True)),
            attention_bias=bool(c.get("attention_bias", False)),
            num_nextn_predict_layers=mtp,
        )
        # HF's DeepSeek-V3 adds no auxiliary loss (it balances with the bias): its
        # output_router_logits is kept as an uninterpreted key, written back as read.
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults(tuple(n for n in self.GEMMA_FEATURES if n != "attn_scale"))
        self._require(
            not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm)
            and set(self.layer_windows) == {None}
            and self.layer_mlps == self._default_layer_mlps()
            and self.attn_scale == self._default_attn_scale(),
            "no sliding windows, q/k norms or other biases, the first first_k_dense_replace "
            "layers dense and the rest MoE, MLA's softmax scale",
        )
        out = self._common_to_hf(architectures)
        del out["head_dim"]  # HF derives it (qk_rope_head_dim)
        out.update(
            num_key_value_heads=self.num_attention_heads,
            n_routed_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            n_shared_experts=self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace,
            rope_interleave=self.rope_interleave,
            attention_bias=self.attention_bias,
            num_nextn_predict_layers=self.num_nextn_predict_layers,
        )
        return out


def key_table(config: DeepseekV3Config) -> KeyTable:
    """The family's key table bound to ``config``'s layer groups, ignoring the
    multi-token-prediction layers (HF layer indices from ``num_hidden_layers`` on)."""
    n, mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    ignore = tuple(rf"(model\.)?layers\.{i}\..*" for i in range(n, n + mtp))
    table = dataclasses.replace(HF_KEYS, ignore_hf=ignore)
    return table.with_layer_groups(config.layer_groups)


class DeepseekV3DecoderLayer(DecoderLayer):
    """A pre-norm block of MLA and a dense or grouped-MoE MLP."""

    self_attn: MultiHeadLatentAttention
    mlp: GatedMLP | GroupedMoE

    @classmethod
    def init(
        cls, config: DecoderConfig, *, mlp: str = "dense", dtype: DTypeLike, key: PRNGKeyArray
    ) -> DeepseekV3DecoderLayer:
        c = config
        k_attn, k_mlp = jax.random.split(key)
        std = c.initializer_range
        attn = MultiHeadLatentAttention.init(
            c.hidden_size,
            c.num_attention_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            bias=c.attention_bias,
            rope_interleave=c.rope_interleave,
            std=std,
            dtype=dtype,
            key=k_attn,
        )
        if mlp == "moe":
            block = GroupedMoE.init(
                c.hidden_size,
                c.expert_intermediate_size,
                c.num_experts,
                c.num_experts_per_tok,
                n_shared=c.n_shared_experts,
                n_group=c.n_group,
                topk_group=c.topk_group,
                routed_scaling_factor=c.routed_scaling_factor,
                normalize=c.norm_topk_prob,
                act=c.hidden_act,
                std=std,
                dtype=dtype,
                key=k_mlp,
            )
        else:
            block = GatedMLP.init(
                c.hidden_size,
                c.intermediate_size,
                act=c.hidden_act,
                std=std,
                dtype=dtype,
                key=k_mlp,
            )
        return cls(attn, block, _norm(c, dtype), _norm(c, dtype), None, None)


# MLA's projections: the head-expanding ones split their outputs over tp, the low-rank
# down-projections (small outputs) only their inputs over fsdp; then the shared rules.
_MLA_RULES = (
    (r"(q_b_proj|kv_b_proj)(\.base_layer)?\.weight$", P(None, "tp", "fsdp")),
    (r"(q_a_proj|kv_a_proj_with_mqa)(\.base_layer)?\.weight$", P(None, None, "fsdp")),
    (r"gate\.(weight|e_score_correction_bias)$", P()),
)


class DeepseekV3Model(DecoderModel):
    """The DeepSeek-V3 decoder trunk (dense prefix in ``dense_layers``, MoE in ``layers``)."""

    partition_rules: ClassVar = _MLA_RULES + PARTITION_RULES
    layer_cls: ClassVar[type[DecoderLayer]] = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 decoder + LM head."""

    trunk: ClassVar[type[DecoderModel]] = DeepseekV3Model


class DeepseekV3ForSequenceClassification(DecoderForSequenceClassification):
    """DeepSeek-V3 decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = DeepseekV3Model
