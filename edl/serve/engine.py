"""A continuous-batching inference engine over edl's paged KV cache.

    engine = Engine(model, max_batch=8, max_model_len=2048, eos_token_ids=(2,))
    engine.warmup()  # optional: compile every step shape now rather than on first use
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finished, out.finish_reason)

Requests wait in a FIFO queue (``max_queue``; ``QueueFull`` beyond it) until one of the
``max_batch`` batch places and their pages are free. Each ``step`` admits what fits, then
makes at most two model calls (``edl.serve.step.model_step``): one token for every decoding
request, then one prompt chunk (up to ``prefill_chunk`` tokens) for each of the oldest
prefilling requests that fit the step's prefill budget (``prefill_tokens``: padded rows x
width). A long prompt is so prefilled over several steps while the other requests keep
decoding, and decoding rows never run at a prefill's width.

Speculative decoding (``speculative=SpeculativeConfig(...)``, ``edl.serve.speculation``):
each step drafts up to ``k`` tokens per decoding request, by prompt lookup (``"ngram"``) or
with a draft model (``"draft"``, ``draft_model=``: ``edl.serve.draft``, its own page pools
under the same page table); when some row drafted, the decode call has width ``k + 1`` and
``model_step``'s every-position logits verify the drafts, each row emitting its accepted
drafts and one token more (``RequestOutput.new_token_ids`` then holds several), its
``computed`` set back past the rejected positions. Greedy output equals plain decoding's.

Phi-3's LongRoPE (``edl.serve.refill``): a request whose cache reaches
``original_max_position_embeddings`` has those tokens re-run through its own pages with the
long factors before its next call, as ``generate`` re-runs the sequence; prefill chunks read
the factors of the whole prompt's length; such requests share no prefix pages.

Compiled shapes: a call's rows are a power of two (or ``max_batch``), the fewest holding its
requests; a prefill call's width is a power of four from 16 (or ``prefill_chunk``), the
narrowest holding its longest chunk; its page table is cut to a power of four pages from 4
(or ``pages_per_seq``), the fewest holding its longest row after the step, and attention
reads exactly those pages. ``step_shapes()`` lists the ``(rows, width, pages)`` (decode:
width 1; verification: ``k + 1``; prefill: ``rows * width <= prefill_tokens``;
``edl.serve.shapes``): a busy engine never compiles after
``warmup()``, one request decodes at one row's cost instead of ``max_batch`` rows', and short
sequences do not read a ``max_model_len`` cache.

The model runs with its layer stacks cut into separate layers once, at construction
(``model.unstacked()``): inside a compiled layer scan XLA:CPU copies every layer's weights out
of the stack on every call, which at batch 1 costs more than the step's own arithmetic
(``benchmarks/RESULTS.md``, "serve: unstacked decoding without weight copies"). The engine
holds that copy (one more copy of the weights while the caller keeps its model); compile time
grows with depth. ``unstack_layers=False`` skips the cut: the engine runs the caller's own
arrays, each call slicing the stacks inside its program (GRPO's rollouts,
``edl.train.rollout_engine``).

Attention on CPU: decode calls (width 1) read each row's pages where they lie, through edl's
native kernel (``edl.kernels.native``, picked by ``edl.ops.paged_attention``); XLA alone
must first gather every row's pages into a contiguous copy per layer, which made attention
half of a 16-row decode step (``benchmarks/RESULTS.md``, "serve: paged attention read in
place on CPU"). Prefill calls (width 16 and up) keep the gathered form: there XLA's GEMMs
beat the kernel's per-key loops.

Split of state: the device side is pure (``model_step``: model, page pools, page table,
tokens, sampling settings in; pools and next tokens out). The ``Engine`` object holds the
host scheduler (queue, batch places, ``PagePool``) and, between steps, the latest page pools:
a serving loop has to keep the cache somewhere from one call to the next, and each call
donates the pools it is given, so the engine must own the only reference to them.

Pages: a request gets every page it can ever need (prompt + ``max_tokens``) when it is
admitted, so a running request never waits for memory and nothing is ever preempted; they
go back the moment it finishes or is aborted. With ``prefix_caching``, the whole prompt
pages it shares with an earlier request (same page-aligned token blocks,
``edl.serve.pages``) are that request's pages, shared and reference-counted, and are not
computed again (at least the prompt's last token always is, for the first logits); a
finished request's prompt pages stay cached, counted as free, until a fresh page is
needed (least recently released first), so a system prompt is computed once.

Recurrent states (Qwen3-Next's Gated DeltaNet; a trunk with ``RECURRENT_STATE``,
``edl.serve.state_slots``): each running request also owns a state slot, taken at
admission and given back at finish or abort; a row at cache length 0 starts from zero
states, and chunked prefill carries them from chunk to chunk. Such a model shares no
prefix pages (``prefix_caching`` is off: pages hold keys / values, not the state after
them) and is refused with ``speculative`` (rejected drafts cannot leave the state).

The engine is not thread-safe: call it from one thread (an async server runs ``step`` in
a loop and queues ``add_request`` / ``abort`` to that loop, or holds one lock around all).

Log-probs (``SamplingParams.logprobs`` / ``prompt_logprobs``, ``edl.serve.logprobs``): a
call computes them only when one of its requests asks: the sampled tokens' from their raw
logits (``step.sampled_logprobs``), and in a prefill chunk every position's log-probs of the
next prompt token, through ``model_step``'s log-prob variant of its shape
(``step_programs()``: each shape twice; ``warmup`` compiles both). Prompt log-probs need
every prompt position computed, so such requests share no cached prefix pages.

Sampling is per request (``SamplingParams``; ``edl.serve.sampler``: a small program after
each model call, ``edl.ops.sampling.RowSampling``), each token drawn with the key
``fold_in(key(seed), tokens_generated_so_far)``: a seed gives the same tokens whatever
else is in the batch (up to float rounding: a request's logits come from calls of shapes
that depend on its company). Outputs carry the cumulative log-prob of the sampled tokens,
and include the EOS / stop token that ends a request (``finish_reason="stop"``); stop
*strings* are the server's (it detokenizes, trims and aborts the request). A request's
grammar (``SamplingParams.grammar``; an engine built with ``tokenizer=``) masks its logits
before sampling, in the sampler's masked program, run only for calls where some row has a
grammar; the request ends ("stop") where the grammar is complete (``edl.serve.grammar``).

Not done: lazy page allocation with preemption (reserving for ``max_tokens`` up front
over-reserves when requests stop early); caching blocks of generated tokens (multi-turn
chats reuse only their prompt's blocks); sharding over a mesh. On GPU ``impl="auto"`` sends
a prefill (or verification) call to the Pallas paged *decode* kernel with ``width`` queries
per row, untested there.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from edl.compile_cache import cache_hits
from edl.generate.decode import _without_id_checks
from edl.generate.speculative import SpeculativeConfig
from edl.generate.steps import CausalLM, ImageTextLM, refill_length, with_row_rope_lengths
from edl.serve import logprobs as lp
from edl.serve import refill
from edl.serve.grammar import Grammars
from edl.serve.multimodal import text_model
from edl.serve.pages import PagePool, block_hashes
from edl.serve.requests import Request, call_inputs, check_request, page_pools
from edl.serve.sampler import Sampler
from edl.serve.shapes import (
    bucket,
    buckets,
    check_sizes,
    prefill_batch,
    shape_name,
    step_shapes,
    warmup_progress,
)
from edl.serve.speculation import Speculation
from edl.serve.state_slots import StateSlots, check_speculation
from edl.serve.step import model_step, sampled_logprobs
from edl.serve.types import QueueFull, RequestOutput, SamplingParams, is_int

__all__ = ["Engine"]


def _checked(
    model: CausalLM, eos_token_ids: Sequence[int], num_pages: int | None, default_pages: int
) -> tuple[tuple[int, ...], int]:
    """The engine's model, EOS ids and page count checked: ``(eos ids, num_pages)``, the
    pool ``default_pages`` (``max_batch`` full-length requests) where none is given."""
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"Engine needs a causal LM (edl.generate.CausalLM), got {type(model).__name__}"
        )
    vocab, eos = model.config.vocab_size, tuple(eos_token_ids)
    if not all(is_int(i) and 0 <= i < vocab for i in eos):
        raise ValueError(f"Engine: eos_token_ids must lie in [0, {vocab}): {eos}")
    num_pages = default_pages if num_pages is None else num_pages
    if not is_int(num_pages) or num_pages < 1:
        raise ValueError(f"Engine: num_pages must be an integer >= 1, got {num_pages!r}")
    return eos, num_pages


def _buckets(
    max_batch: int, prefill_chunk: int, pages_per_seq: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The engine's row, prefill-width and page buckets (module docstring, "Compiled
    shapes")."""
    rows = buckets(max_batch, 1, 2)
    widths = buckets(prefill_chunk, min(16, prefill_chunk), 4)
    # From 4 pages: reading a few unused pages costs less than compiling more shapes.
    return rows, widths, buckets(pages_per_seq, min(4, pages_per_seq), 4)


def _step_model(model: CausalLM, unstack_layers: bool) -> CausalLM:
    """The model ``model_step`` runs: prompts are checked in ``add_request``, each request's
    RoPE length is its own (``RunOptions.rope_length``), the layers cut apart once with
    ``unstack_layers`` (module docstring)."""
    model = with_row_rope_lengths(_without_id_checks(model))
    return model.unstacked() if unstack_layers else model


class Engine:
    """Continuous batching over a paged KV cache (module docstring)."""

    def __init__(
        self,
        model: CausalLM | ImageTextLM,
        *,
        max_batch: int = 8,
        max_model_len: int = 2048,
        page_size: int = 16,
        num_pages: int | None = None,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        prefill_tokens: int | None = None,
        eos_token_ids: Sequence[int] = (),
        prefix_caching: bool = True,
        echo: Callable[[str], None] | None = None,
        tokenizer: Any = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: Any = None,
        kv_cache_dtype: str = "auto",
        unstack_layers: bool = True,
    ):
        """Args:
        model: a causal LM (``edl.generate.CausalLM``), or a vision-language model
            (LLaVA, Gemma 3's ``gemma3``) whose language model then serves text
            (``edl.serve.multimodal``).
        max_batch: requests running at once (decoding or prefilling).
        max_model_len: prompt + generated tokens of one request, at most.
        page_size: tokens per KV-cache page.
        num_pages: the page pool (default: ``max_batch`` full-length requests).
        max_queue: waiting requests, at most (``QueueFull`` beyond).
        prefill_chunk: prompt tokens one request prefills per step, at most.
        prefill_tokens: a prefill call's padded size (rows x width), at most (default
            ``prefill_chunk``; at least that).
        eos_token_ids: ids that end every request (``finish_reason="stop"``).
        prefix_caching: share whole prompt pages between running requests (off for a
            model with recurrent states, ``edl.serve.state_slots``).
        echo: hears each step shape's first call (``"compiling decode 8x1, 4 pages
            (first use) ..."``, then how long it took), and ``warmup``'s progress; None:
            silent.
        tokenizer: the model's ``edl.text.HFTokenizer``: requests may then carry a grammar
            (``SamplingParams.grammar``, ``edl.serve.grammar``); None: they may not.
        speculative: draft and verify tokens (``edl.serve.speculation``); None: plain
            decoding. ``draft_model``: the draft of ``method="draft"`` (a smaller causal LM
            with the target's vocabulary).
        kv_cache_dtype: the pages' storage (``edl.ops.kv_quant.KV_CACHE_DTYPES``):
            ``"auto"`` (the model's dtype), ``"int8"`` or ``"fp8_e4m3"`` (quantized, one
            float32 scale per token and KV head; the paged kernels read them). Refused
            for models with their own cache layout (DeepSeek-V3's latents, Qwen3-Next).
        unstack_layers: cut the layer stacks apart once (module docstring; a copy of the
            layer weights). False: run the caller's own arrays, stacked (no copy; each call
            then slices the layers inside the program), as GRPO's rollouts do
            (``edl.train.rollout_engine``).
        """
        model = text_model(model)  # a vision-language model: its language model, no copy
        prefill_tokens = prefill_chunk if prefill_tokens is None else prefill_tokens
        check_sizes(
            max_batch=max_batch,
            max_model_len=max_model_len,
            page_size=page_size,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            prefill_tokens=prefill_tokens,
        )
        self.vocab_size = model.config.vocab_size
        self.pages_per_seq = -(-max_model_len // page_size)
        eos, num_pages = _checked(model, eos_token_ids, num_pages, max_batch * self.pages_per_seq)
        self.max_batch, self.max_model_len, self.page_size = max_batch, max_model_len, page_size
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.prefill_tokens = prefill_tokens
        check_speculation(model, speculative, draft_model)
        # Recurrent states (edl.serve.state_slots): one slot per request, no shared prefixes.
        self._states = StateSlots(model, max_batch)
        prefix_caching = prefix_caching and not self._states.recurrent
        self.eos_token_ids, self.prefix_caching = frozenset(eos), prefix_caching
        self.row_buckets, self.width_buckets, self.page_buckets = _buckets(
            max_batch, prefill_chunk, self.pages_per_seq
        )
        self._model = _step_model(model, unstack_layers)
        self._refill_limit = refill_length(model)  # LongRoPE's original context (refill)
        self._k_pages, self._v_pages = page_pools(
            model, num_pages, page_size, max_model_len, kv_cache_dtype
        )
        self._pool = PagePool(num_pages)
        self._running: list[Request] = []  # admitted, oldest first (at most max_batch)
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[int, Request] = {}  # waiting or running, by id
        self._pending: list[RequestOutput] = []  # abort notices for the next step
        self._next_id = 0
        self._rng = np.random.default_rng()  # seeds of requests that give none
        self._echo = echo
        self._compiled: set[tuple[int, int, int, bool, bool]] = set()  # programs called
        self._grammars = None if tokenizer is None else Grammars(tokenizer, self.vocab_size, eos)
        self._sampler = Sampler(max_batch, self.vocab_size, max_model_len)
        geometry = dict(num_pages=num_pages, page_size=page_size, max_model_len=max_model_len)
        geometry.update(row_buckets=self.row_buckets, page_buckets=self.page_buckets)
        self._spec = (
            None if speculative is None else Speculation(speculative, model, draft_model, geometry)
        )

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self._pool.num_pages

    @property
    def speculation_counts(self) -> tuple[int, int] | None:
        """Draft tokens proposed and accepted so far (``/metrics``); None: no speculation."""
        return None if self._spec is None else (self._spec.drafted, self._spec.accepted)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted."""
        return len(self._waiting)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. ValueError for a prompt that is empty, holds
        ids outside the vocabulary, or with ``max_tokens`` exceeds ``max_model_len`` or the
        page pool; QueueFull when ``max_queue`` requests wait already."""
        prompt = tuple(prompt_ids)
        pages = (self.page_size, self.num_total_pages)
        check_request(prompt, params, self.vocab_size, self.max_model_len, *pages)
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue)")
        seed = int(self._rng.integers(2**32)) if params.seed is None else params.seed
        # Prompt log-probs need every prompt position computed: no shared pages.
        sharing = self.prefix_caching and params.prompt_logprobs is None
        sharing &= refill.may_share(self._refill_limit, len(prompt), params.max_tokens)
        hashes = block_hashes(prompt, self.page_size) if sharing else []
        stop = self.eos_token_ids | frozenset(params.stop_token_ids)
        request = Request(self._next_id, prompt, params, seed, stop, hashes)
        if params.grammar is not None:
            if self._grammars is None:
                raise ValueError("add_request: a grammar needs an Engine built with a tokenizer")
            request.matcher = self._grammars.matcher(params.grammar)
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
        if not request.running:
            self._waiting.remove(request)
        else:
            self._release(request)
        self._pending.append(RequestOutput(request_id, (), True, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self._live or self._pending)

    def _release(self, request: Request) -> None:
        self._pool.release(request.pages)
        self._sampler.release(request.slot)
        self._states.release(request.id)
        request.pages = []
        self._running.remove(request)
        request.running = False

    def _admit(self) -> None:
        """Move waiting requests, oldest first, into the batch while their pages fit."""
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            shareable = (len(request.prompt) - 1) // self.page_size  # the last token runs
            shared = self._pool.match(request.hashes[:shareable])
            fresh = self._pages_for(len(request.prompt) + request.params.max_tokens)
            fresh -= len(shared)
            if fresh > self._pool.num_free:
                self._pool.release(shared)
                return  # wait for running requests to free pages (first come, first served)
            request.pages = shared + self._pool.allocate(fresh)
            request.computed = request.draft_computed = len(shared) * self.page_size
            request.published = len(shared)
            request.running = True
            request.slot = self._sampler.admit(request.prompt, request.params)
            self._states.admit(request.id)
            self._running.append(request)
            self._waiting.popleft()

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every ``(rows, width, pages)`` a step may call the model with (the module
        docstring): decode (``width == 1``), speculative verification (``width == k + 1``,
        with ``speculative``), then prefill."""
        return [shape for kind in self._shapes() for shape in kind]

    def _shapes(self) -> tuple[list[tuple[int, int, int]], ...]:
        """The decode, verification and prefill shapes (``shapes.step_shapes``)."""
        k = 0 if self._spec is None else self._spec.k
        return step_shapes(
            self.row_buckets, self.width_buckets, self.page_buckets, self.prefill_tokens, k
        )

    def warmup(self) -> None:
        """Compile ``model_step`` for every shape of ``step_shapes()`` now (each call runs
        rows with no tokens: the cache is unchanged), so serving never waits on XLA. Takes
        seconds per shape for a deep model (the layers are unrolled), less where jax's
        persistent compilation cache has them. ``echo`` hears each shape as it compiles:
        ``compiling decode 8x1, 4 pages (3/12): 2.1 s; 6.3 s so far, about 19 s left``.
        Every program of ``step_programs()`` (with and without log-probs); the samplers
        (``edl.serve.sampler``: plain and penalized per row bucket, grammar-masked too with a
        tokenizer, and the penalty reset) compile first, in well under a second."""
        words = None if self._grammars is None else self._grammars.words
        self._sampler.warmup(self.row_buckets, words)
        if self._spec is not None:
            self._spec.warmup(self.row_buckets, self.vocab_size, self.step_shapes())
        programs = [key for key in self.step_programs() if key not in self._compiled]
        start = time.perf_counter()
        for done, program in enumerate(programs, 1):
            t0, hits = time.perf_counter(), cache_hits()
            rows, width, pages, logprobs, verify = program
            self._call([], rows, width, pages, logprobs, [] if verify else None)
            if self._echo is not None:
                now, cached = time.perf_counter(), cache_hits() > hits
                line = warmup_progress(program, done, len(programs), now - t0, now - start, cached)
                self._echo(line)

    def step_programs(self) -> list[tuple[int, int, int, bool, bool]]:
        """Every model program ``warmup`` compiles: ``(rows, width, pages, logprobs,
        verify)``: each decode and prefill shape of ``step_shapes()`` without and with
        log-probs (``model_step``'s ``logprobs`` variant), each verification shape once
        (``model_step``'s ``every`` variant)."""
        decode, verify, prefill = self._shapes()
        plain = [(*s, lp_, False) for lp_ in (False, True) for s in decode + prefill]
        return plain + [(*s, False, True) for s in verify]

    def _call(
        self,
        requests: list[Request],
        rows: int,
        width: int,
        pages: int,
        logprobs: bool = False,
        drafts: list[np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray] | None, list[Any] | None]:
        """One ``model_step`` over ``requests`` (``_inputs``), then the sampler (grammar rows
        masked) on each row's last new token's logits (with ``drafts``, the pending
        token's: ``model_step``'s ``every`` variant, then ``Speculation.verify``). Returns
        each row's sampled token, its log-prob, the call's log-prob arrays (when a request
        asks, or ``logprobs``) and the verdicts (None without drafts); records prompt
        log-probs; advances ``computed`` past each row's new tokens (a verified row's:
        its pending token and accepted drafts)."""
        tokens, num_new, lengths, table = call_inputs(
            requests, rows, width, pages, self.page_size, drafts
        )
        floor = refill.rope_floor(self._refill_limit, requests, rows)
        runner = None if self._spec is None else self._spec.runner
        if runner is not None and requests and requests[0].prefilling:  # a prefill call
            runner.prefill(requests, table, lengths, tokens, num_new)
        # A row emits its token when it decodes or its prompt ends in this call.
        emit = [r.computed + int(num_new[i]) >= len(r.prompt) for i, r in enumerate(requests)]
        matchers = [r.matcher if e else None for r, e in zip(requests, emit, strict=True)]
        matchers += [None] * (rows - len(requests))
        logprobs = logprobs or lp.needs_logprobs(requests)
        allowed = None
        if any(m is not None for m in matchers):
            assert self._grammars is not None  # requests have matchers only with it
            allowed = jnp.asarray(self._grammars.bitmask(matchers, rows))
        verify = drafts is not None
        key = (rows, width, pages, logprobs and not verify, verify)
        first = key not in self._compiled and self._echo is not None and bool(requests)
        if first:  # a request waits on this compile: say so (warmup reports its own)
            self._echo(f"compiling {shape_name(key)} (first use) ...")
        t0, hits = time.perf_counter(), cache_hits()
        logits, prompt = self._run(
            [r.id for r in requests],
            (table, lengths, tokens, num_new),
            jnp.asarray(lp.prompt_targets(requests, rows, width)) if key[3] else None,
            logprobs=key[3],
            **({"every": True} if verify else {}),
            **({} if floor is None else {"rope_min_length": jnp.asarray(floor)}),
        )
        every, logits = (logits, logits[:, 0]) if verify else (None, logits)
        settings = [(r.params, r.seed, len(r.generated)) for r in requests]
        slots = [r.slot for r in requests]
        next_tokens, token_logprobs = self._sampler.sample(logits, settings, slots, emit, allowed)
        sampled = sampled_logprobs(logits, jnp.asarray(next_tokens)) if logprobs else None
        arrays = lp.host_arrays(prompt, sampled)
        verdicts = None
        if verify and requests:
            assert self._spec is not None and drafts is not None  # verify: drafts given
            verdicts = self._spec.verify(every, requests, drafts)
        if first:
            how = "from the compilation cache" if cache_hits() > hits else "compiled"
            self._echo(f"{shape_name(key)} ready in {time.perf_counter() - t0:.1f} s ({how})")
        self._compiled.add(key)
        for i, r in enumerate(requests):
            if r.prefilling and r.params.prompt_logprobs is not None:
                r.prompt_logprobs += lp.prompt_entries(arrays, i, r, int(num_new[i]))
            verdict = None if verdicts is None else verdicts[i]
            r.computed += int(num_new[i]) if verdict is None else 1 + verdict[2]
        return next_tokens, token_logprobs, arrays, verdicts

    def _pages_after(self, requests: list[Request], new: list[int]) -> int:
        """The page bucket holding every request's tokens after a call adding ``new[i]`` to
        request ``i``."""
        longest = max(r.computed + n for r, n in zip(requests, new, strict=True))
        return bucket(self.page_buckets, self._pages_for(longest))

    def _prefill_batch(self) -> tuple[list[Request], int, int]:
        """The oldest prefilling requests whose padded chunks fit ``prefill_tokens``, and the
        call's ``(rows, width)`` (``shapes.prefill_batch``)."""
        chunks = [
            (r, min(len(r.prompt) - r.computed, self.prefill_chunk))
            for r in self._running
            if r.prefilling
        ]
        return prefill_batch(chunks, self.row_buckets, self.width_buckets, self.prefill_tokens)

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, one token (or, speculating, a verified run of tokens) for
        every decoding request, one prompt chunk for the oldest prefilling ones (module
        docstring); report and free what finished."""
        outputs, self._pending = self._pending, []
        self._admit()
        decoding = [r for r in self._running if not r.prefilling]
        self._refill(refill.crossing(self._refill_limit, decoding))
        if decoding:
            drafts = None if self._spec is None else self._spec.drafts(decoding)
            drafts = refill.cap_drafts(self._refill_limit, decoding, drafts)
            width = 1 if drafts is None else self._spec.k + 1  # type: ignore[union-attr]
            new = [1 + (0 if drafts is None else len(d)) for d in drafts or decoding]
            rows, pages = bucket(self.row_buckets, len(decoding)), self._pages_after(decoding, new)
            next_tokens, token_logprobs, arrays, verdicts = self._call(
                decoding, rows, width, pages, drafts=drafts
            )
            for i, r in enumerate(decoding):
                verdict = None if verdicts is None else verdicts[i]
                if verdict is None:  # one token, the sampler's
                    verdict = ([next_tokens[i]], [token_logprobs[i]], 0)
                outputs.append(self._emit(r, verdict[0], verdict[1], arrays, i))
        prefilling, rows, width = self._prefill_batch()
        if prefilling:
            new = [min(width, len(r.prompt) - r.computed) for r in prefilling]
            pages = self._pages_after(prefilling, new)
            next_tokens, token_logprobs, arrays, _ = self._call(prefilling, rows, width, pages)
            for i, r in enumerate(prefilling):
                self._publish(r)
                if not r.prefilling:  # its prompt is done: the first token is out
                    outputs.append(self._emit(r, [next_tokens[i]], [token_logprobs[i]], arrays, i))
        return outputs

    def _refill(self, requests: list[Request]) -> None:
        """Re-run each request's first ``refill_length`` tokens through its own pages with
        LongRoPE's long factors, before the call that feeds its token at that position
        (``edl.serve.refill``); the calls' logits are dropped."""
        for r in requests:
            chunks = refill.refill_chunks(
                r,
                r.computed,
                self.prefill_chunk,
                self.page_size,
                self.width_buckets,
                self.page_buckets,
            )
            long_factors = jnp.asarray([r.computed + 1], jnp.int32)
            for tokens, num_new, lengths, table in chunks:
                inputs = (table, lengths, tokens, num_new)
                self._run([r.id], inputs, None, logprobs=False, rope_min_length=long_factors)

    def _run(
        self,
        request_ids: list[int],
        inputs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        prompt_targets: Any,
        **options: Any,
    ) -> tuple[Any, Any]:
        """``model_step`` on the engine's pools (kept, as the call donates them) for the
        host arrays ``(table, lengths, tokens, num_new)`` (``requests.call_inputs``), through
        the state slots of ``request_ids``; returns its logits and prompt log-prob arrays."""
        table, lengths, tokens, num_new = (jnp.asarray(x) for x in inputs)
        self._k_pages, self._v_pages, logits, prompt = self._states.run(
            model_step,
            request_ids,
            self._model,
            self._k_pages,
            self._v_pages,
            table,
            lengths,
            tokens,
            num_new,
            prompt_targets,
            **options,
        )
        return logits, prompt

    def _publish(self, request: Request) -> None:
        """Offer the request's computed whole prompt blocks to the prefix cache."""
        done = min(request.computed, len(request.prompt)) // self.page_size
        for j in range(request.published, min(done, len(request.hashes))):
            self._pool.publish(request.pages[j], request.hashes[j])
        request.published = max(request.published, done)

    def _emit(
        self,
        request: Request,
        tokens: list[Any],
        logprobs: list[Any],
        arrays: dict[str, np.ndarray] | None,
        row: int,
    ) -> RequestOutput:
        """Record generated tokens (none at ``max_tokens=0``; several from a verification),
        up to the first that finishes the request (a stop token, its grammar complete, its
        length), with their log-probs where asked (one token, then). A request's first
        output carries its prompt log-probs where asked."""
        p = request.params
        new, reason = request.record(tokens, logprobs, Grammars.advance)
        if reason is not None:
            self._release(request)
            del self._live[request.id]
        entries = prompt = None
        if p.logprobs is not None and new and arrays is not None:
            entries = (lp.sampled_entry(arrays, row, new[0], p.logprobs),)
        if p.prompt_logprobs is not None and len(request.generated) <= 1:
            prompt, request.prompt_logprobs = tuple(request.prompt_logprobs), []
        return RequestOutput(
            request.id,
            tuple(new),
            reason is not None,
            reason,
            entries,
            prompt,
            request.cumulative_logprob,
        )
