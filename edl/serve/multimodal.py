"""Vision-language models in the serving engine: text requests only, through the language
model.

A vision-language model (``edl.models.LlavaForConditionalGeneration`` and Gemma 3's
``Gemma3ForConditionalGeneration``, the ``edl.generate.steps.ImageTextLM`` protocol) serves
text through its language model with its head, ``model.text_lm()``: the family's causal LM
over the same arrays (no copy), which is what ``edl.generate`` decodes a text-only prompt
with. ``Engine`` and ``edl serve`` take either kind of model through :func:`text_model`.

Missing: images in served requests. Chat messages' image parts are refused by
``edl.serve.messages`` (a 400 naming the part); ``edl.generate.generate(...,
pixel_values=)`` takes images.
"""

from __future__ import annotations

from typing import Any

from edl.generate.steps import CausalLM, ImageTextLM

__all__ = ["text_model"]


def text_model(model: Any) -> CausalLM | Any:
    """The causal LM that serves ``model``'s text: a vision-language model's language model
    with its head (``text_lm()``, the same arrays), any other model as it is (the engine
    checks it)."""
    return model.text_lm() if isinstance(model, ImageTextLM) else model
