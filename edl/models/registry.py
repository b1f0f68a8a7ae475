"""edl's model families, registered in the table of ``edl.models.families`` (whose names
this module re-exports: ``Family``, ``register``, ``resolve``, ``family_for``,
``family_of``, ``architecture``, ``TASKS``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edl.models import (
    clip,
    deepseek_v3,
    gemma,
    gemma3,
    gemma3_vision,
    gpt_oss,
    llama,
    llava,
    mixtral,
    olmo,
    phi3,
    qwen3_moe,
    qwen3_next,
    siglip,
    smollm3,
)
from edl.models.encoder_config import (
    CLIPConfig,
    CLIPTextConfig,
    CLIPVisionConfig,
    SiglipConfig,
    SiglipTextConfig,
    SiglipVisionConfig,
)
from edl.models.families import (
    TASKS,
    Family,
    architecture,
    family_for,
    family_of,
    register,
    registered,
    resolve,
)

__all__ = [
    "TASKS",
    "Family",
    "architecture",
    "family_for",
    "family_of",
    "register",
    "registered",
    "resolve",
]

_DECODER_TASKS = ("causal_lm", "sequence_classification", "base")


def _family(name: str, module: Any, config_cls: type, prefix: str, hf_names: Mapping) -> Family:
    """A family whose classes are ``<prefix>Model`` / ``ForCausalLM`` /
    ``ForSequenceClassification`` in ``module``."""
    return register(
        Family(
            name=name,
            config_cls=config_cls,
            key_table=module.HF_KEYS,
            tasks={task: getattr(module, prefix + TASKS[task]) for task in _DECODER_TASKS},
            hf_names=hf_names,
        )
    )


LLAMA = _family(
    "llama",
    llama,
    llama.LlamaConfig,
    "Llama",
    {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"},
)
GEMMA = _family("gemma", gemma, gemma.GemmaConfig, "Gemma", {"gemma": "Gemma"})
GEMMA2 = _family("gemma2", gemma, gemma.Gemma2Config, "Gemma2", {"gemma2": "Gemma2"})
MIXTRAL = _family("mixtral", mixtral, mixtral.MixtralConfig, "Mixtral", {"mixtral": "Mixtral"})
PHI3 = _family("phi3", phi3, phi3.Phi3Config, "Phi3", {"phi3": "Phi3"})
QWEN3_MOE = _family(
    "qwen3_moe", qwen3_moe, qwen3_moe.Qwen3MoeConfig, "Qwen3Moe", {"qwen3_moe": "Qwen3Moe"}
)
GPT_OSS = _family("gpt_oss", gpt_oss, gpt_oss.GptOssConfig, "GptOss", {"gpt_oss": "GptOss"})
QWEN3_NEXT = _family(
    "qwen3_next", qwen3_next, qwen3_next.Qwen3NextConfig, "Qwen3Next", {"qwen3_next": "Qwen3Next"}
)
OLMO2 = _family("olmo2", olmo, olmo.Olmo2Config, "Olmo2", {"olmo2": "Olmo2"})
OLMO3 = _family("olmo3", olmo, olmo.Olmo3Config, "Olmo3", {"olmo3": "Olmo3"})
SMOLLM3 = _family("smollm3", smollm3, smollm3.SmolLM3Config, "SmolLM3", {"smollm3": "SmolLM3"})
GEMMA3_TEXT = register(
    Family(
        name="gemma3_text",
        config_cls=gemma3.Gemma3TextConfig,
        key_table=gemma3.HF_KEYS,
        tasks={t: getattr(gemma3, gemma3.ARCHITECTURES[t]) for t in _DECODER_TASKS},
        hf_names={"gemma3_text": "Gemma3Text"},
        architectures=gemma3.ARCHITECTURES,
    )
)
DEEPSEEK_V3 = register(
    Family(
        name="deepseek_v3",
        config_cls=deepseek_v3.DeepseekV3Config,
        key_table=deepseek_v3.key_table,  # skips the multi-token-prediction layers
        tasks={t: getattr(deepseek_v3, "DeepseekV3" + TASKS[t]) for t in _DECODER_TASKS},
        hf_names={"deepseek_v3": "DeepseekV3", "kimi_k2": "DeepseekV3"},
    )
)

# Vision and vision-language models.
CLIP = register(
    Family("clip", CLIPConfig, clip.dual_key_table(), {"base": clip.CLIPModel}, {"clip": "CLIP"})
)
CLIP_TEXT = register(
    Family(
        "clip_text_model",
        CLIPTextConfig,
        clip.bare_tower_key_table("text_model."),
        {"base": clip.CLIPTextModel, "with_projection": clip.CLIPTextModelWithProjection},
        {"clip_text_model": "CLIPText"},
        {"with_projection": clip.dual_key_table()},
    )
)
CLIP_VISION = register(
    Family(
        "clip_vision_model",
        CLIPVisionConfig,
        clip.bare_tower_key_table("vision_model."),
        {"base": clip.CLIPVisionModel, "with_projection": clip.CLIPVisionModelWithProjection},
        {"clip_vision_model": "CLIPVision"},
        {"with_projection": clip.dual_key_table()},
    )
)
SIGLIP = register(
    Family(
        "siglip",
        SiglipConfig,
        clip.dual_key_table(),
        {"base": siglip.SiglipModel},
        {"siglip": "Siglip"},
    )
)
SIGLIP_TEXT = register(
    Family(
        "siglip_text_model",
        SiglipTextConfig,
        clip.bare_tower_key_table("text_model."),
        {"base": siglip.SiglipTextModel},
        {"siglip_text_model": "SiglipText"},
    )
)
SIGLIP_VISION = register(
    Family(
        "siglip_vision_model",
        SiglipVisionConfig,
        clip.bare_tower_key_table("vision_model."),
        {"base": siglip.SiglipVisionModel},
        {"siglip_vision_model": "SiglipVision"},
    )
)
LLAVA = register(
    Family(
        "llava",
        llava.LlavaConfig,
        llava.key_table,
        {"conditional_generation": llava.LlavaForConditionalGeneration, "base": llava.LlavaModel},
        {"llava": "Llava"},
        module_table=llava.module_key_table,
    )
)

# Gemma 3's multimodal model: LLaVA's file layout and module names over its own classes.
GEMMA3 = register(
    Family(
        "gemma3",
        gemma3_vision.Gemma3Config,
        llava.key_table,
        {
            "conditional_generation": gemma3_vision.Gemma3ForConditionalGeneration,
            "base": gemma3_vision.Gemma3Model,
        },
        {"gemma3": "Gemma3"},
        module_table=llava.module_key_table,
    )
)
