"""A continuous-batching inference engine over edl's paged KV cache.

    engine = Engine(model, max_batch=8, max_model_len=2048, eos_token_ids=(2,))
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finished, out.finish_reason)

Requests wait in a FIFO queue (``max_queue``; ``QueueFull`` beyond it) until a batch slot
and their pages are free. Each ``step`` admits what fits, then runs ONE model call
(``edl.serve.step.model_step``) in which every prefilling slot advances by up to
``prefill_chunk`` prompt tokens and every decoding slot by one token, so a long prompt is
prefilled over several steps while the other requests keep decoding. The call has one of
two fixed shapes, ``(max_batch, 1)`` or ``(max_batch, prefill_chunk)`` tokens over a
``(max_batch, pages_per_seq)`` page table: two compilations, then none.

Split of state: the device side is pure (``model_step``: model, page pools, page table,
tokens, sampling settings in; pools and next tokens out). The ``Engine`` object holds the
host scheduler (queue, slots, ``PagePool``) and, between steps, the latest page pools: a
serving loop has to keep the cache somewhere from one call to the next, and each call
donates the pools it is given, so the engine must own the only reference to them.

Pages: a request gets every page it can ever need (prompt + ``max_tokens``) when it is
admitted, so a running request never waits for memory and nothing is ever preempted; they
go back the moment it finishes or is aborted. With ``prefix_caching``, the whole prompt
pages it shares with an earlier, still running request (same page-aligned token blocks,
``edl.serve.pages``) are that request's pages, shared and reference-counted, and are not
computed again (at least the prompt's last token always is, for the first logits).

The engine is not thread-safe: call it from one thread (an async server runs ``step`` in
a loop and queues ``add_request`` / ``abort`` to that loop, or holds one lock around all).

Sampling is per request (``SamplingParams``): greedy at ``temperature=0``, else
temperature, top-k and top-p in HF's order, each token drawn with the key
``fold_in(key(seed), tokens_generated_so_far)``: the same seed gives the same tokens
whatever else is in the batch (up to float rounding: the same request's logits come from
a width-1 or a width-``prefill_chunk`` step depending on its company). Output tokens
include the EOS / stop token that ends a request (``finish_reason="stop"``).

STATUS (start of the serving work; continued in a later session):

- done: the API below; chunked prefill interleaved with decoding in two fixed shapes;
  per-request greedy / temperature / top-k / top-p with seeds; upfront page allocation
  and freeing on finish / abort; prompt-prefix sharing of whole pages with reference
  counts; tests against ``edl.generate`` (tests/test_serve_engine.py).
- missing: lazy page allocation with preemption (pages are reserved for ``max_tokens``
  up front, which over-reserves when requests stop early); keeping freed prefix pages
  cached for later requests (LRU, as vLLM does: here a prefix is shared only while some
  request holding it runs); hashing generated tokens' blocks; a token budget per step
  (every prefilling slot takes a whole chunk); logits processors beyond temperature /
  top-k / top-p (repetition penalty, min-p), log-probs, stop strings; sharding over a
  mesh; a GPU run: there ``impl="auto"`` sends a width-``prefill_chunk`` step to the
  Pallas paged *decode* kernel with ``prefill_chunk`` queries per row (built for a few),
  untested and likely slow, so chunked prefill may want its own kernel or the XLA path;
  a benchmark in benchmarks/; an async server (the server helper's branch).
- ``eos_token_ids`` is taken as given (default none), not read from the model's
  generation config.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from edl.generate.decode import _without_id_checks
from edl.generate.paged import init_paged_cache
from edl.generate.steps import CausalLM
from edl.serve.pages import PagePool, block_hashes
from edl.serve.step import SlotSampling, model_step
from edl.serve.types import QueueFull, RequestOutput, SamplingParams, is_int

__all__ = ["Engine", "QueueFull", "RequestOutput", "SamplingParams"]


@dataclasses.dataclass(eq=False)
class _Request:
    """Host bookkeeping of one request: its slot, pages and progress."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    hashes: list[bytes]
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the cache
    published: int = 0  # prompt blocks offered to the prefix cache
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


class Engine:
    """Continuous batching over a paged KV cache (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_batch: int = 8,
        max_model_len: int = 2048,
        page_size: int = 16,
        num_pages: int | None = None,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        eos_token_ids: Sequence[int] = (),
        prefix_caching: bool = True,
    ):
        if not isinstance(model, CausalLM):
            raise TypeError(f"Engine needs a causal LM (edl.generate.CausalLM), got "
                            f"{type(model).__name__}")  # fmt: skip
        sizes = dict(max_batch=max_batch, max_model_len=max_model_len, page_size=page_size,
                     max_queue=max_queue, prefill_chunk=prefill_chunk)  # fmt: skip
        bad = {k: v for k, v in sizes.items() if not is_int(v) or v < 1}
        if bad:
            raise ValueError(f"Engine: these must be integers >= 1: {bad}")
        self.vocab_size = model.config.vocab_size
        eos = tuple(eos_token_ids)
        if not all(is_int(i) and 0 <= i < self.vocab_size for i in eos):
            raise ValueError(f"Engine: eos_token_ids must lie in [0, {self.vocab_size}): {eos}")
        self.pages_per_seq = -(-max_model_len // page_size)
        num_pages = max_batch * self.pages_per_seq if num_pages is None else num_pages
        if not is_int(num_pages) or num_pages < 1:
            raise ValueError(f"Engine: num_pages must be an integer >= 1, got {num_pages!r}")
        self.max_batch, self.max_model_len, self.page_size = max_batch, max_model_len, page_size
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.eos_token_ids, self.prefix_caching = frozenset(eos), prefix_caching
        self._model = _without_id_checks(model)  # prompts are checked in add_request
        cache = init_paged_cache(
            model.config, num_pages, page_size, batch=1, cache_len=max_model_len,
            dtype=model.model.embed_tokens.weight.dtype,
        )  # fmt: skip
        # Two buffers (init_paged_cache shares one zero array), as each step donates both.
        self._k_pages, self._v_pages = cache.k_pages, jnp.zeros_like(cache.v_pages)
        self._pool = PagePool(num_pages)
        self._slots: list[_Request | None] = [None] * max_batch
        self._waiting: collections.deque[_Request] = collections.deque()
        self._live: dict[int, _Request] = {}  # waiting or running, by id
        self._pending: list[RequestOutput] = []  # abort notices for the next step
        self._next_id = 0
        self._rng = np.random.default_rng()  # seeds of requests that give none

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self._pool.num_pages

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. ValueError for a prompt that is empty, holds
        ids outside the vocabulary, or with ``max_tokens`` exceeds ``max_model_len`` or the
        page pool; QueueFull when ``max_queue`` requests wait already."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"add_request: params must be SamplingParams, got {type(params)}")
        prompt = tuple(prompt_ids)
        if not prompt:
            raise ValueError("add_request: the prompt is empty")
        bad = [i for i in prompt if not is_int(i) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"add_request: prompt ids {bad[:8]} are not in [0, "
                             f"{self.vocab_size})")  # fmt: skip
        bad = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if bad:
            raise ValueError(f"add_request: stop_token_ids {bad} are not < {self.vocab_size}")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"add_request: prompt ({len(prompt)}) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len "
                             f"{self.max_model_len}")  # fmt: skip
        if self._pages_for(total) > self.num_total_pages:
            raise ValueError(f"add_request: {total} tokens need {self._pages_for(total)} pages, "
                             f"the pool has {self.num_total_pages}")  # fmt: skip
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue)")
        seed = int(self._rng.integers(2**32)) if params.seed is None else params.seed
        hashes = block_hashes(prompt, self.page_size) if self.prefix_caching else []
        stop = self.eos_token_ids | frozenset(params.stop_token_ids)
        request = _Request(self._next_id, prompt, params, seed, stop, hashes)
        self._next_id += 1
        self._waiting.append(request)
        self._live[request.id] = request
        return request.id

    def abort(self, request_id: int) -> None:
        """Drop a request now (its pages are free at once); the next ``step`` reports it
        finished with reason ``"abort"``. Unknown or finished ids are ignored."""
        request = self._live.pop(request_id, None)
        if request is None:
            return
        if request.slot is None:
            self._waiting.remove(request)
        else:
            self._release(request)
        self._pending.append(RequestOutput(request_id, (), True, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self._live or self._pending)

    def _release(self, request: _Request) -> None:
        self._pool.release(request.pages)
        request.pages = []
        self._slots[request.slot] = None

    def _admit(self) -> None:
        """Move waiting requests, oldest first, into free slots while their pages fit."""
        while self._waiting and None in self._slots:
            request = self._waiting[0]
            shareable = (len(request.prompt) - 1) // self.page_size  # the last token runs
            shared = self._pool.match(request.hashes[:shareable])
            fresh = self._pages_for(len(request.prompt) + request.params.max_tokens)
            fresh -= len(shared)
            if fresh > self._pool.num_free:
                self._pool.release(shared)
                return  # wait for running requests to free pages (first come, first served)
            request.pages = shared + self._pool.allocate(fresh)
            request.computed = len(shared) * self.page_size
            request.published = len(shared)
            request.slot = self._slots.index(None)
            self._slots[request.slot] = request
            self._waiting.popleft()

    def _batch(self, running: list[_Request], width: int):
        """The step's host arrays: every running slot's new tokens and settings."""
        b = self.max_batch
        tokens, num_new = np.zeros((b, width), np.int32), np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)
        table = np.full((b, self.pages_per_seq), -1, np.int32)
        temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
        top_k, seed, counter = np.zeros(b, np.int32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
        for r in running:
            s, p = r.slot, r.params
            new = r.prompt[r.computed : r.computed + width] if r.prefilling else r.generated[-1:]
            tokens[s, : len(new)], num_new[s], lengths[s] = new, len(new), r.computed
            table[s, : len(r.pages)] = r.pages
            temperature[s], top_p[s], top_k[s] = p.temperature, p.top_p, p.top_k or 0
            seed[s], counter[s] = r.seed, len(r.generated)
        sampling = SlotSampling(*map(jnp.asarray, (temperature, top_k, top_p, seed, counter)))
        return tokens, num_new, lengths, table, sampling

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, one model call (a prefill chunk for prefilling requests,
        one token for decoding ones), then report and free what finished."""
        outputs, self._pending = self._pending, []
        self._admit()
        running = [r for r in self._slots if r is not None]
        if not running:
            return outputs
        width = self.prefill_chunk if any(r.prefilling for r in running) else 1
        tokens, num_new, lengths, table, sampling = self._batch(running, width)
        self._k_pages, self._v_pages, next_tokens = model_step(
            self._model, self._k_pages, self._v_pages, jnp.asarray(table),
            jnp.asarray(lengths), jnp.asarray(tokens), jnp.asarray(num_new), sampling,
        )  # fmt: skip
        next_tokens = np.asarray(next_tokens)
        for r in running:
            r.computed += int(num_new[r.slot])
            self._publish(r)
            if not r.prefilling:
                outputs.append(self._emit(r, int(next_tokens[r.slot])))
        return outputs

    def _publish(self, request: _Request) -> None:
        """Offer the request's computed whole prompt blocks to the prefix cache."""
        done = min(request.computed, len(request.prompt)) // self.page_size
        for j in range(request.published, min(done, len(request.hashes))):
            self._pool.publish(request.pages[j], request.hashes[j])
        request.published = max(request.published, done)

    def _emit(self, request: _Request, token: int) -> RequestOutput:
        """Record a generated token; finish the request on a stop token or its length."""
        request.generated.append(token)
        reason = None
        if token in request.stop_ids:
            reason = "stop"
        elif len(request.generated) >= request.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._release(request)
            del self._live[request.id]
        return RequestOutput(request.id, (token,), reason is not None, reason)
