"""Model families (Equinox pytrees with HF field names), task heads and the registry.

Every decoder family runs the one decoder of ``edl.models.decoder`` (trunk) and
``edl.models.heads`` (task heads); a family is a config class (reading and writing HF
``config.json``), a declarative HF key table and HF-named classes. The vision families
(``clip``, ``siglip``) run the encoder towers of ``edl.models.towers``; ``llava`` joins a
vision tower to any decoder family, ``gemma3_vision`` (Gemma 3's multimodal model) a SigLIP
tower to Gemma 3's.

The names below are what a user builds or loads a model with: each family's config and its
causal LM (``edl.from_pretrained`` picks the class from ``config.json``), LLaMA's sequence
classifier, the vision models, ``configure`` and ``flops_per_token``. A family's other
classes (the bare trunk ``<Family>Model``, ``<Family>ForSequenceClassification``, the
vision towers and their configs) are in its module: ``edl.models.llama``,
``edl.models.deepseek_v3``, ``edl.models.gemma``, ``edl.models.gemma3``,
``edl.models.gpt_oss``, ``edl.models.mixtral``, ``edl.models.olmo``, ``edl.models.phi3``,
``edl.models.qwen3_moe``, ``edl.models.qwen3_next``, ``edl.models.smollm3``,
``edl.models.clip``, ``edl.models.siglip``, ``edl.models.llava``, ``edl.models.gemma3_vision``,
``edl.models.encoder_config``.
"""

from edl.models import registry
from edl.models.clip import CLIPModel
from edl.models.config import DecoderConfig, RunOptions
from edl.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from edl.models.encoder_config import CLIPConfig, SiglipConfig
from edl.models.flops import flops_per_token
from edl.models.gemma import Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM
from edl.models.gemma3 import Gemma3ForCausalLM, Gemma3TextConfig
from edl.models.gemma3_vision import Gemma3Config, Gemma3ForConditionalGeneration
from edl.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from edl.models.heads import configure
from edl.models.llama import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from edl.models.llava import LlavaConfig, LlavaForConditionalGeneration
from edl.models.mixtral import MixtralConfig, MixtralForCausalLM
from edl.models.olmo import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM
from edl.models.phi3 import Phi3Config, Phi3ForCausalLM
from edl.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from edl.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from edl.models.siglip import SiglipModel
from edl.models.smollm3 import SmolLM3Config, SmolLM3ForCausalLM

__all__ = [
    "CLIPConfig",
    "CLIPModel",
    "DecoderConfig",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma3TextConfig",
    "GemmaConfig",
    "GemmaForCausalLM",
    "GptOssConfig",
    "GptOssForCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlavaConfig",
    "LlavaForConditionalGeneration",
    "MixtralConfig",
    "MixtralForCausalLM",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "Olmo3Config",
    "Olmo3ForCausalLM",
    "Phi3Config",
    "Phi3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    "RunOptions",
    "SiglipConfig",
    "SiglipModel",
    "SmolLM3Config",
    "SmolLM3ForCausalLM",
    "configure",
    "flops_per_token",
    "registry",
]
