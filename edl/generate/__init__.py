"""Generation: KV caches and a compiled decode loop (greedy, sampling, beam search).

out = edl.generate.generate(model, input_ids, attention_mask=mask, max_new_tokens=32)
text = edl.generate.generate_text(model, tokenizer, "Once upon a time", max_new_tokens=32)
"""

from edl.generate.beam import BeamState
from edl.generate.cache import KVCache, init_cache
from edl.generate.config import GenerateOutput, GenerationConfig
from edl.generate.decode import (
    DecodeState,
    generate,
    generate_stream,
    logits_processor_for,
    prompt_bucket,
)
from edl.generate.paged import (
    PagedCacheConfig,
    PagedKVCache,
    free_rows,
    init_paged_cache,
    paged_cache_config,
)
from edl.generate.steps import CausalLM, CausalTrunk
from edl.generate.text import TextStream, generate_text, prompt_ids, stream_text

__all__ = [
    "BeamState",
    "CausalLM",
    "CausalTrunk",
    "DecodeState",
    "GenerateOutput",
    "GenerationConfig",
    "KVCache",
    "PagedCacheConfig",
    "PagedKVCache",
    "TextStream",
    "free_rows",
    "generate",
    "generate_stream",
    "generate_text",
    "init_cache",
    "init_paged_cache",
    "logits_processor_for",
    "paged_cache_config",
    "prompt_bucket",
    "prompt_ids",
    "stream_text",
]
