"""GPT-OSS (HF ``model_type`` gpt_oss): attention with sinks and biases over alternating
sliding-window / full layers, YaRN RoPE, and an MoE MLP in every layer with a biased router,
biased experts and the clamped SwiGLU (``edl.nn.gpt_oss_moe``).

- Attention: q/k/v/o projections with biases (``attention_bias``), one learned sink logit per
  query head (``self_attn.sinks``, ``DecoderConfig.attention_sinks``: ``edl.ops.attention``'s
  ``sinks``), a sliding window on the ``"sliding_attention"`` layers of ``layer_types``
  (by default every even layer: a stack scans periods of two layers, so compile time stays
  flat in depth).
- MoE: ``mlp.router`` (weight and bias), top-k of the logits then softmax over those;
  experts in transformers' layout (``mlp.experts.gate_up_proj`` ``(experts, dim, 2 * inter)``
  with gate / up interleaved, ``gate_up_proj_bias``, ``down_proj`` ``(experts, inter, dim)``,
  ``down_proj_bias``), stored as they are in the file, so files round-trip byte-equal.
- RoPE: ``rope_parameters`` as the file gives them (YaRN, factor 32, by default).

The released checkpoints (openai/gpt-oss-20b, -120b) ship MXFP4-quantised experts
(``quantization_config.quant_method = "mxfp4"``, ``*_blocks`` / ``*_scales`` tensors):
``from_pretrained`` dequantises them at load to the model's dtype, bit for bit as
transformers' ``Mxfp4Config(dequantize=True)`` (``edl.io.formats.mxfp4``); the config read
drops ``quantization_config``, so saving writes the dequantised layout (no re-quantising
save). Other quantisation methods are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray

from edl.models.config import DecoderConfig
from edl.models.decoder import MOE_BLOCKS, PARTITION_RULES, DecoderModel
from edl.models.heads import DecoderForCausalLM, DecoderForSequenceClassification
from edl.models.keymap import decoder_key_table
from edl.models.llama_config import windows_of_layer_types
from edl.nn.gpt_oss_moe import GptOssMoE
from edl.ops.rope import RopeConfig
from edl.ops.sharding import Rules

__all__ = [
    "HF_KEYS",
    "GptOssConfig",
    "GptOssForCausalLM",
    "GptOssForSequenceClassification",
    "GptOssModel",
]

# edl's module tree uses HF's names (self_attn.sinks, mlp.router, mlp.experts.gate_up_proj...).
HF_KEYS = decoder_key_table()

_READ = frozenset(
    {
        "attention_bias",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts_per_tok",
        "swiglu_alpha",
        "swiglu_limit",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_z_loss_coef",
    }
)

# transformers' GptOssConfig default when a file names no RoPE.
_HF_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """GPT-OSS architecture (defaults: transformers' ``GptOssConfig``, gpt-oss-120b's shape).

    ``swiglu_alpha`` / ``swiglu_limit``: the experts' clamped SwiGLU
    (``edl.nn.gpt_oss_moe.clamped_swiglu``)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gpt_oss",)
    ROPE_THETA: ClassVar[float] = 150000.0
    MOE_BLOCK: ClassVar[str] = "gpt_oss"
    WRITES: ClassVar[frozenset[str]] = frozenset({"attention_sinks"})

    model_type: str = "gpt_oss"
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = True
    o_bias: bool = True
    sliding_window: int | None = 128
    attention_sinks: bool = True
    num_experts: int = 128
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = True  # softmax over the top-k logits
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        # HF: sliding on even layers, full on odd ones.
        return tuple(
            self.sliding_window if i % 2 == 0 else None for i in range(self.num_hidden_layers)
        )

    def _default_rope(self) -> RopeConfig:
        return RopeConfig.from_hf(
            {"rope_parameters": {**_HF_DEFAULT_ROPE, "rope_theta": self.ROPE_THETA}},
            self.head_dim,
            default_theta=self.ROPE_THETA,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> GptOssConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields. An MXFP4
        ``quantization_config`` is dropped (its tensors are dequantised at load), any other
        raises ``ValueError`` naming the method."""
        c = dict(config)
        cls._check_model_type(c)
        quant = c.pop("quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        if quant and method != "mxfp4":  # MXFP4 is dequantised at load (edl.io.formats.mxfp4)
            raise ValueError(
                f"config.json: quantization_config with quant_method {method!r} is not "
                "supported: edl loads GPT-OSS's bfloat16 layout and its MXFP4 checkpoints"
            )
        if not any(k in c for k in ("rope_parameters", "rope_scaling")):
            c["rope_parameters"] = {**_HF_DEFAULT_ROPE, "rope_theta": c.get("rope_theta", 150000.0)}
        fields = cls._common_from_hf(c)
        d = cls._default
        n, window = fields["num_hidden_layers"], c.get("sliding_window", d("sliding_window"))
        layer_types = c.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
        bias = bool(c.get("attention_bias", True))
        fields.update(
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
            sliding_window=window,
            layer_windows=windows_of_layer_types(layer_types, window, n),
            num_experts=c.get("num_local_experts", d("num_experts")),
            num_experts_per_tok=c.get("num_experts_per_tok", d("num_experts_per_tok")),
            norm_topk_prob=True,
            swiglu_alpha=float(c.get("swiglu_alpha", d("swiglu_alpha"))),
            swiglu_limit=float(c.get("swiglu_limit", d("swiglu_limit"))),
            **cls._router_from_hf(c),
        )
        return cls._build(c, fields, _READ, overrides)

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        self._require_defaults((*self.GEMMA_FEATURES, "mlp_bias", "qk_norm"))
        sizes = {w for w in self.layer_windows if w is not None}
        self._require(
            self.attention_sinks
            and self.qkv_bias == self.o_bias
            and set(self.layer_mlps) == {"moe"}
            and self.norm_topk_prob
            and self.expert_intermediate_size == self.intermediate_size
            and len(sizes) <= 1,
            "attention sinks, one attention bias, every layer MoE with softmax over the top-k, "
            "experts as wide as intermediate_size, one sliding_window size",
        )
        out = self._common_to_hf(architectures)
        out.update(
            attention_bias=self.qkv_bias,
            sliding_window=sizes.pop() if sizes else self.sliding_window,
            layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in self.layer_windows
            ],
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
            **self._router_to_hf(),
        )
        return out


def _gpt_oss_moe(c: GptOssConfig, *, std: float, dtype: DTypeLike, key: PRNGKeyArray) -> GptOssMoE:
    return GptOssMoE.init(
        c.hidden_size,
        c.expert_intermediate_size,
        c.num_experts,
        c.num_experts_per_tok,
        alpha=c.swiglu_alpha,
        limit=c.swiglu_limit,
        std=std,
        dtype=dtype,
        key=key,
    )


MOE_BLOCKS["gpt_oss"] = _gpt_oss_moe

# The experts' HF layout: gate_up (layers, experts, dim, 2 * inter) and down (layers,
# experts, inter, dim): experts over expert, hidden size over fsdp, the MLP width over tp
# (gathered inside the expert-parallel dispatch, which adds each bias once); before the
# generic rules, which assume torch's (out, in) expert layout.
GPT_OSS_PARTITION_RULES: Rules = (
    # (\.base_layer)?: the expert weights under LoRA adapters (edl.nn.lora_experts)
    (r"experts(\.base_layer)?\.gate_up_proj$", P(None, "expert", "fsdp", "tp")),
    (r"experts(\.base_layer)?\.gate_up_proj_bias$", P(None, "expert", "tp")),
    (r"experts(\.base_layer)?\.down_proj$", P(None, "expert", "tp", "fsdp")),
    (r"experts(\.base_layer)?\.down_proj_bias$", P(None, "expert", None)),
    *PARTITION_RULES,
)


class GptOssModel(DecoderModel):
    """The GPT-OSS decoder trunk (sinks, alternating windows, biased MoE in every layer)."""

    partition_rules: ClassVar[Rules] = GPT_OSS_PARTITION_RULES


class GptOssForCausalLM(DecoderForCausalLM):
    """GPT-OSS decoder + LM head; ``compute_loss`` adds the router's auxiliary loss."""

    trunk: ClassVar[type[DecoderModel]] = GptOssModel
    partition_rules: ClassVar[Rules] = GPT_OSS_PARTITION_RULES


class GptOssForSequenceClassification(DecoderForSequenceClassification):
    """GPT-OSS decoder + ``score`` head at each row's last non-pad token."""

    trunk: ClassVar[type[DecoderModel]] = GptOssModel
    partition_rules: ClassVar[Rules] = GPT_OSS_PARTITION_RULES
