"""Model families (Equinox pytrees with HF field names), task heads and the registry.

Every decoder family runs the one decoder of ``edl.models.decoder`` (trunk) and
``edl.models.heads`` (task heads); a family is a config class (reading and writing HF
``config.json``), a declarative HF key table and HF-named classes. The vision families
(``clip``, ``siglip``) run the encoder towers of ``edl.models.towers``; ``llava`` joins a
vision tower to any decoder family.
"""

from edl.models import (
    clip,
    decoder,
    gemma,
    heads,
    llama,
    llava,
    mixtral,
    qwen3_moe,
    registry,
    siglip,
)
from edl.models.clip import (
    CLIPModel,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
)
from edl.models.config import DecoderConfig, RunOptions, flops_per_token
from edl.models.encoder_config import (
    CLIPConfig,
    CLIPTextConfig,
    CLIPVisionConfig,
    SiglipConfig,
    SiglipTextConfig,
    SiglipVisionConfig,
)
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
from edl.models.llava import LlavaConfig, LlavaForConditionalGeneration, LlavaModel
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
from edl.models.siglip import SiglipModel, SiglipTextModel, SiglipVisionModel

__all__ = [
    "CLIPConfig",
    "CLIPModel",
    "CLIPTextConfig",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "CLIPVisionConfig",
    "CLIPVisionModel",
    "CLIPVisionModelWithProjection",
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
    "LlavaConfig",
    "LlavaForConditionalGeneration",
    "LlavaModel",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MixtralForSequenceClassification",
    "MixtralModel",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeForSequenceClassification",
    "Qwen3MoeModel",
    "RunOptions",
    "SiglipConfig",
    "SiglipModel",
    "SiglipTextConfig",
    "SiglipTextModel",
    "SiglipVisionConfig",
    "SiglipVisionModel",
    "clip",
    "configure",
    "decoder",
    "flops_per_token",
    "gemma",
    "heads",
    "llama",
    "llava",
    "mixtral",
    "qwen3_moe",
    "registry",
    "siglip",
]
