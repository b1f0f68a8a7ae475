"""The engine's host bookkeeping of one request (``Request``: its pages, progress and
sampling state), the host check that a call's page table covers a row's new tokens, and the
page pools the engine allocates once. Moved out of ``edl.serve.engine`` so the scheduler
stays one readable file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edl.generate.paged import init_paged_cache
from edl.generate.steps import CausalLM
from edl.serve.types import Logprob, SamplingParams, is_int

__all__ = ["Request", "call_inputs", "check_pages", "check_request", "page_pools"]


@dataclasses.dataclass(eq=False)
class Request:
    """Host bookkeeping of one request: its pages and progress. A decoding request's cache
    holds ``computed`` tokens: its prompt and all generated tokens but the last (the
    pending one, fed to the next call)."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    hashes: list[bytes]
    running: bool = False
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache
    published: int = 0  # prompt blocks offered to the prefix cache
    generated: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = dataclasses.field(default_factory=lambda: [None])
    matcher: Any = None  # its grammar's state (edl.serve.grammar), if it has one
    slot: int = -1  # its batch place while running (edl.serve.sampler: penalty state)
    cumulative_logprob: float = 0.0  # its sampled tokens' log-probs, summed
    # Speculative decoding's back-off (edl.serve.speculation): verifications in a row that
    # accepted no draft, and the steps left before it drafts again.
    draft_misses: int = 0
    draft_computed: int = 0  # tokens in a draft model's cache (edl.serve.draft)
    draft_pause: int = 0
    # Its prompt and generated tokens as one array (the first history_len filled), kept
    # by speculative decoding's prompt lookup.
    history: np.ndarray | None = None
    history_len: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def record(
        self,
        tokens: Sequence[Any],
        logprobs: Sequence[Any],
        grammar_done: Callable[[Any, int], bool],
    ) -> tuple[list[int], str | None]:
        """Append generated ``tokens`` (several from a speculative verification; none at
        ``max_tokens=0``) with their ``logprobs``, up to the first that finishes the
        request: a stop token or its grammar complete (``grammar_done(matcher, token)``,
        which also advances the matcher) give ``"stop"``, ``max_tokens`` ``"length"``.
        Returns the tokens kept and the finish reason (None: it goes on)."""
        if self.params.max_tokens == 0:
            return [], "length"
        new: list[int] = []
        for token, logprob in zip(map(int, tokens), logprobs, strict=True):
            new.append(token)
            self.generated.append(token)
            self.cumulative_logprob += float(logprob)
            if token in self.stop_ids:
                return new, "stop"
            if self.matcher is not None and grammar_done(self.matcher, token):
                return new, "stop"  # the grammar is complete and admits nothing more
            if len(self.generated) >= self.params.max_tokens:
                return new, "length"
        return new, None


def check_pages(request: Request, new: int, pages: int, page_size: int) -> None:
    """The step's table row (``pages`` of the request's pages) holds its ``new`` tokens: the
    host's check, which the compiled step does not repeat (``edl.serve.step``)."""
    needed = -(-(request.computed + new) // page_size)
    if needed > min(len(request.pages), pages):
        raise RuntimeError(
            f"Engine: request {request.id} needs {needed} pages for {request.computed} + "
            f"{new} tokens, its table row holds {min(len(request.pages), pages)} "
            f"({len(request.pages)} allocated, {pages} in the step's table)"
        )


def call_inputs(
    requests: Sequence[Request],
    rows: int,
    width: int,
    pages: int,
    page_size: int,
    drafts: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A model call's host arrays ``(tokens (rows, width), num_new (rows,), lengths (rows,),
    table (rows, pages))``: each request's prompt chunk (up to ``width`` tokens) or its last
    generated token (then its ``drafts``, speculating), at ``lengths`` = its ``computed``,
    padded to ``rows`` rows (no tokens, no pages), its page table cut to ``pages`` and
    checked to hold its new tokens (``check_pages``)."""
    tokens, num_new = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
    lengths = np.zeros(rows, np.int32)
    table = np.full((rows, pages), -1, np.int32)
    for i, r in enumerate(requests):
        new = r.prompt[r.computed : r.computed + width] if r.prefilling else r.generated[-1:]
        if drafts:
            new = [*new, *drafts[i]]
        check_pages(r, len(new), pages, page_size)
        tokens[i, : len(new)], num_new[i], lengths[i] = new, len(new), r.computed
        table[i, : min(len(r.pages), pages)] = r.pages[:pages]
    return tokens, num_new, lengths, table


def page_pools(
    model: CausalLM,
    num_pages: int,
    page_size: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
) -> tuple[Any, Any]:
    """The key and value page pools ``(layers, num_pages, page_size, kv_heads, head_dim)``
    in the embedding's dtype, or ``kv_cache_dtype``'s ``QuantizedPages`` (codes and scales,
    ``edl.ops.kv_quant``): two buffers (``init_paged_cache`` shares one zero array), as
    each step donates both. A model with recurrent states (Qwen3-Next) caches the keys /
    values of its attention layers here and its states in ``edl.serve.state_slots``."""
    cache = init_paged_cache(
        model.config,
        num_pages,
        page_size,
        batch=1,
        cache_len=max_model_len,
        dtype=model.model.embed_tokens.weight.dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    return cache.k_pages, jax.tree.map(jnp.zeros_like, cache.v_pages)


def check_request(
    prompt: tuple[int, ...],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    page_size: int,
    num_pages: int,
) -> None:
    """``Engine.add_request``'s checks of one request: ValueError for a prompt that is
    empty, holds ids outside the vocabulary, or with ``max_tokens`` exceeds
    ``max_model_len`` or the page pool (``num_pages`` of ``page_size`` tokens); stop ids
    and logit-bias ids outside the vocabulary."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"add_request: params must be SamplingParams, got {type(params)}")
    if not prompt:
        raise ValueError("add_request: the prompt is empty")
    bad = [i for i in prompt if not is_int(i) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"add_request: prompt ids {bad[:8]} are not in [0, {vocab_size})")
    bad = [i for i in params.stop_token_ids if i >= vocab_size]
    if bad:
        raise ValueError(f"add_request: stop_token_ids {bad} are not < {vocab_size}")
    bad = [i for i, _ in params.logit_bias if i >= vocab_size]
    if bad:
        raise ValueError(f"add_request: logit_bias ids {bad} are not < {vocab_size}")
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"add_request: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) = "
            f"{total} exceeds max_model_len {max_model_len}"
        )
    if -(-total // page_size) > num_pages:
        raise ValueError(
            f"add_request: {total} tokens need {-(-total // page_size)} pages, "
            f"the pool has {num_pages}"
        )
