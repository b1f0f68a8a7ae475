"""Model families (Equinox pytrees with HF field names), task heads and the registry."""

from edl.models import llama, registry
from edl.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    configure,
    flops_per_token,
)

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaModel",
    "configure",
    "flops_per_token",
    "llama",
    "registry",
]
