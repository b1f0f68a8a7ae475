"""Generation: KV caches and a compiled decode loop (greedy, sampling, beam search).

out = edl.generate.generate(model, input_ids, attention_mask=mask, max_new_tokens=32)
text = edl.generate.generate_text(model, tokenizer, "Once upon a time", max_new_tokens=32)

The decode loop's own state and helpers (``edl.generate.decode``, ``edl.generate.beam``,
``edl.generate.steps``) and the paged cache's geometry (``edl.generate.paged``) are in their
modules. Speculative decoding: ``generate(..., speculative=SpeculativeConfig(...))``
(``edl.generate.speculative``; drafters in ``proposers``, verification in ``verify``).
"""

from edl.generate.cache import KVCache, init_cache
from edl.generate.config import GenerateOutput, GenerationConfig, SpeculativeStats
from edl.generate.decode import generate, generate_stream
from edl.generate.paged import PagedKVCache, free_rows, init_paged_cache, paged_cache_config
from edl.generate.speculative import SpeculativeConfig
from edl.generate.steps import CausalLM
from edl.generate.text import generate_text, prompt_ids, stream_text

__all__ = [
    "CausalLM",
    "GenerateOutput",
    "GenerationConfig",
    "KVCache",
    "PagedKVCache",
    "SpeculativeConfig",
    "SpeculativeStats",
    "free_rows",
    "generate",
    "generate_stream",
    "generate_text",
    "init_cache",
    "init_paged_cache",
    "paged_cache_config",
    "prompt_ids",
    "stream_text",
]
