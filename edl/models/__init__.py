"""Model families (Equinox pytrees with HF field names), task heads and the registry.

Every family runs the one decoder of ``edl.models.decoder`` (trunk) and ``edl.models.heads``
(task heads); a family is a config class
(reading and writing HF ``config.json``), a declarative HF key table and HF-named classes.
"""

from edl.models import decoder, gemma, heads, llama, mixtral, qwen3_moe, registry
from edl.models.config import DecoderConfig, RunOptions, flops_per_token
from edl.models.gemma import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma2ForSequenceClassification,
    Gemma2Model,
    GemmaConfig,
    GemmaForCausalLM,
    GemmaForSequenceClassification,
    GemmaModel,
)
from edl.models.heads import configure
from edl.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
)
from edl.models.mixtral import (
    MixtralConfig,
    MixtralForCausalLM,
    MixtralForSequenceClassification,
    MixtralModel,
)
from edl.models.qwen3_moe import (
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeForSequenceClassification,
    Qwen3MoeModel,
)

__all__ = [
    "DecoderConfig",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma2ForSequenceClassification",
    "Gemma2Model",
    "GemmaConfig",
    "GemmaForCausalLM",
    "GemmaForSequenceClassification",
    "GemmaModel",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaModel",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MixtralForSequenceClassification",
    "MixtralModel",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeForSequenceClassification",
    "Qwen3MoeModel",
    "RunOptions",
    "configure",
    "decoder",
    "flops_per_token",
    "gemma",
    "heads",
    "llama",
    "mixtral",
    "qwen3_moe",
    "registry",
]
