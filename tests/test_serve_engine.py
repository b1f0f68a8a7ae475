"""edl.serve.Engine: continuous batching over the paged KV cache.

The oracle for tokens is ``edl.generate.generate`` (itself tested against transformers):
a request's greedy tokens must be exactly generate's for its prompt, whatever joins the
batch and whether its prompt pages are shared. The scheduler's bookkeeping (pages, slots,
prefix sharing) is checked over random schedules with the model step replaced by a stub,
so hundreds of steps cost no compilation.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edl.generate import generate
from edl.serve import Engine, QueueFull, SamplingParams
from edl.serve import engine as engine_module
from edl.serve.pages import PagePool, block_hashes
from edl.serve.requests import Request, check_pages
from edl.serve.step import model_step, reset_penalty_slot, sample_step, sample_step_penalized

# One geometry for every test that runs the model, so the module compiles model_step for
# its four step shapes (rows 1 | 2 | 4 x width 1, or 1 x 8; 4 pages) and no more.
GEOMETRY = dict(max_batch=4, max_model_len=32, page_size=8, prefill_chunk=8)
MAX_TOKENS = 8


# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 64, n).tolist() for n in lengths]


def _greedy_reference(model, prompts, max_new: int) -> list[list[int]]:
    """generate's greedy tokens for each prompt (one left-padded batch)."""
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
    return np.asarray(out.sequences[:, width:]).tolist()


def _run(engine: Engine, schedule: dict[int, list], *, watch=None):
    """Step until done, adding ``schedule[step]``'s ``(prompt, params)`` before that step.
    Returns ``(tokens, reasons)`` per request, in the order added; ``watch(step)`` is called
    after each step."""
    ids, tokens, reasons, step = [], {}, {}, 0
    while engine.has_unfinished() or step <= max(schedule):
        for prompt, params in schedule.get(step, []):
            ids.append(engine.add_request(prompt, params))
            tokens[ids[-1]] = []
        for out in engine.step():
            assert out.request_id not in reasons, "output after finishing"
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if watch is not None:
            watch(step)
        step += 1
        assert step < 500, "the engine does not finish"
    return [tokens[i] for i in ids], [reasons[i] for i in ids]


def test_engine_greedy_matches_generate_mid_flight_prefix_sharing_no_recompiles(tiny_llama):
    # A: 19 tokens, prefilled in 3 chunks; C shares A's first two pages and joins while A
    # decodes; D joins later; B is short. Then seeded sampling, alone and in company.
    a, b, d = _prompts(0, (19, 5, 3))
    c = [*a[:16], 7, 7, 3]
    prompts = [a, b, c, d]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    schedule = {0: [(a, greedy), (b, greedy)], 3: [(c, greedy)], 5: [(d, greedy)]}
    want = _greedy_reference(tiny_llama, prompts, MAX_TOKENS)
    compiled_before = model_step._cache_size()
    engine = Engine(tiny_llama, **GEOMETRY)
    assert engine.step_shapes() == [(1, 1, 4), (2, 1, 4), (4, 1, 4), (1, 8, 4)]
    engine.warmup()  # every shape, with and without log-probs, and the samplers
    warm = model_step._cache_size()
    samplers = [sample_step, sample_step_penalized, reset_penalty_slot]
    warm_samplers = [f._cache_size() for f in samplers]
    assert warm - compiled_before <= 8
    assert engine.num_free_pages == engine.num_total_pages and not engine.has_unfinished()

    free_after_join = {}
    for caching in (True, False):
        engine = Engine(tiny_llama, prefix_caching=caching, **GEOMETRY)
        watch = lambda s, e=engine, k=caching: free_after_join.setdefault(k, e.num_free_pages)
        got, reasons = _run(engine, schedule, watch=lambda s, w=watch: s == 3 and w(s))
        assert got == want, f"prefix_caching={caching}"
        assert reasons == ["length"] * 4
        assert engine.num_free_pages == engine.num_total_pages
    # C took A's two whole prompt pages instead of two new ones.
    assert free_after_join[True] == free_after_join[False] + 2
    # Those pages stay cached after everyone finished: C alone again skips its first 16
    # tokens (its first token comes out of the first step, not the third) and still decodes
    # exactly generate's tokens.
    engine = Engine(tiny_llama, **GEOMETRY)
    _run(engine, {0: [(a, greedy)]})
    assert engine._pool.num_cached == 2 and engine.num_free_pages == engine.num_total_pages
    rid = engine.add_request(c, greedy)
    assert [out.new_token_ids for out in engine.step()] == [tuple(want[2][:1])]
    assert engine._pool.users(engine._running[0].pages[0]) == 1  # shared, in use again
    engine.abort(rid)
    engine.step()
    got, _ = _run(engine, {0: [(c, greedy)]})
    assert got == [want[2]]

    # An EOS id ends a request with its EOS included, as generate does.
    eos = want[1][3]
    engine = Engine(tiny_llama, eos_token_ids=(eos,), **GEOMETRY)
    got, reasons = _run(engine, {0: [(b, greedy)]})
    assert got == [want[1][: want[1].index(eos) + 1]] and reasons == ["stop"]

    # Seeded sampling: the same tokens alone and joining a busy batch; another seed differs.
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=11)
    engine = Engine(tiny_llama, **GEOMETRY)
    (alone,), _ = _run(engine, {0: [(c, sampled)]})
    busy = {0: [(a, greedy), (b, dataclasses.replace(sampled, seed=3))], 2: [(c, sampled)]}
    (_, other_seed, batched), _ = _run(engine, busy)
    assert batched == alone and other_seed != alone
    # A penalized request (the penalized sampler, its state reset) compiles nothing either.
    penalized = dataclasses.replace(greedy, repetition_penalty=1.5, presence_penalty=0.5)
    (got,), _ = _run(engine, {0: [(c, penalized)]})
    assert len(got) == MAX_TOKENS and got != want[2]
    assert model_step._cache_size() == warm
    assert [f._cache_size() for f in samplers] == warm_samplers


def test_add_request_rejects_bad_input_and_a_full_queue(tiny_llama):
    engine = Engine(tiny_llama, max_queue=2, **GEOMETRY)
    params = SamplingParams(max_tokens=4)
    cases = [
        ([], "empty"),
        ([1, 64], "not in"),
        ([1, -1], "not in"),
        ([1] * 30, "exceeds max_model_len"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1], SamplingParams(stop_token_ids=(64,)))
    small = Engine(tiny_llama, num_pages=2, **GEOMETRY)
    with pytest.raises(ValueError, match="the pool has 2"):
        small.add_request([1] * 20, params)
    for bad in [
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(seed=-1),
        dict(stop_token_ids=(-2,)),
    ]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    first = engine.add_request([1], params)
    engine.add_request([2], params)
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        engine.add_request([3], params)
    engine.abort(first)  # a waiting request can go, which makes room
    engine.add_request([3], params)


def test_engine_sizes_are_checked_naming_them(tiny_llama):
    with pytest.raises(ValueError, match=r"integers >= 1: \{'max_batch': 0, 'page_size': -1\}"):
        Engine(tiny_llama, max_batch=0, page_size=-1)
    with pytest.raises(
        ValueError, match=r"prefill_tokens \(8\) must be at least prefill_chunk \(16"
    ):
        Engine(tiny_llama, prefill_chunk=16, prefill_tokens=8)
    with pytest.raises(ValueError, match=r"eos_token_ids must lie in \[0, 64\)"):
        Engine(tiny_llama, eos_token_ids=(64,))


@pytest.mark.slow  # ~200 engine steps and a wide generate batch, compiled (~20 s)
def test_random_schedule_with_aborts_matches_generate_and_frees_pages(tiny_llama):
    rng = np.random.default_rng(7)
    engine = Engine(tiny_llama, num_pages=12, **GEOMETRY)
    prefix = rng.integers(0, 64, 16).tolist()
    prompts, tokens, aborted, finished = {}, {}, set(), {}
    for _ in range(150):
        if rng.random() < 0.4:
            n = int(rng.integers(1, 21))
            prompt = (
                (prefix + rng.integers(0, 64, 4).tolist())[:n]
                if rng.random() < 0.5
                else rng.integers(0, 64, n).tolist()
            )
            with contextlib.suppress(QueueFull):
                rid = engine.add_request(prompt, SamplingParams(max_tokens=32 - n, temperature=0.0))
                prompts[rid], tokens[rid] = prompt, []
        if rng.random() < 0.05 and prompts:
            rid = int(rng.choice(list(prompts)))
            if rid not in finished:
                engine.abort(rid)
                aborted.add(rid)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert engine.num_free_pages == engine.num_total_pages
    assert finished.keys() == prompts.keys() and len(prompts) > 40 and len(aborted) > 2
    assert {r for r, why in finished.items() if why == "abort"} <= aborted
    rids = sorted(prompts)
    references = _greedy_reference(tiny_llama, [prompts[r] for r in rids], 31)
    for rid, reference in zip(rids, references, strict=True):
        prompt, got = prompts[rid], tokens[rid]
        want = reference[: 32 - len(prompt)]
        assert got == want[: len(got)], rid
        assert finished[rid] == "abort" or len(got) == len(want)


# -- the scheduler over random schedules (the model step stubbed) ------------------------------


def _stub_step(page_size: int, rng: np.random.Generator, shapes):
    """A ``model_step`` stand-in that checks what the scheduler hands the model: the token
    shape is one of the engine's, each busy row's page table covers its new tokens, padding
    rows hold no pages and no row writes (its new tokens and the chunk's padding) into a
    page another row holds. It returns no log-probs (no request here asks)."""

    def step(model, k, v, table, lengths, tokens, num_new, targets=None, *, logprobs):
        table, lengths, num_new = map(np.asarray, (table, lengths, num_new))
        assert (*tokens.shape, table.shape[1]) in shapes, (tokens.shape, table.shape)
        busy = num_new > 0
        have = (table >= 0).sum(axis=1)
        assert np.all(-(-(lengths + num_new) // page_size)[busy] <= have[busy])
        assert np.all(have[~busy] == 0)
        for row in np.flatnonzero(busy):
            first = lengths[row] // page_size
            end = -(-(lengths[row] + tokens.shape[1]) // page_size)
            written = set(table[row, first:end].tolist()) - {-1}
            others = set(np.delete(table, row, axis=0).ravel().tolist())
            assert not written & others, f"row {row} writes into a shared page"
        # Logits that leave one token possible per row: greedy and sampled rows take it.
        chosen = rng.integers(0, 64, table.shape[0])
        logits = np.where(np.arange(64) == chosen[:, None], 0.0, -np.inf).astype(np.float32)
        return k, v, jnp.asarray(logits), None

    return step


def _random_request(rng: np.random.Generator, prefix: list[int]):
    """A 1-23 token prompt (half of them starting with ``prefix``) and settings that fit
    GEOMETRY's 32 tokens, ending early at a stop id."""
    n = int(rng.integers(1, 24))
    prompt = (
        (prefix + rng.integers(0, 64, n).tolist())[:n]
        if rng.random() < 0.5
        else rng.integers(0, 64, n).tolist()
    )
    params = SamplingParams(
        max_tokens=int(rng.integers(1, 32 - n + 1)), stop_token_ids=(5,), seed=0
    )
    return prompt, params


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_pages_return_to_the_pool_over_random_schedules(tiny_llama, monkeypatch, prefix_caching):
    rng = np.random.default_rng(0)
    shared = 0  # steps after which running requests share pages
    # A wider prefill budget than GEOMETRY's, so prefill calls take several rows.
    engine = Engine(
        tiny_llama,
        num_pages=12,
        prefix_caching=prefix_caching,
        **{**GEOMETRY, "prefill_tokens": 16},
    )
    shapes = engine.step_shapes()
    assert (2, 8, 4) in shapes
    monkeypatch.setattr(engine_module, "model_step", _stub_step(8, rng, shapes))
    total, live, seen = engine.num_total_pages, set(), 0
    shared_prefix = rng.integers(0, 64, 16).tolist()
    for _ in range(250):
        action = rng.random()
        if action < 0.3:
            with contextlib.suppress(QueueFull):
                live.add(engine.add_request(*_random_request(rng, shared_prefix)))
        elif action < 0.4 and live:
            engine.abort(int(rng.choice(sorted(live))))
        for out in engine.step():
            seen += len(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
        assert 0 <= engine.num_free_pages <= total
        held = [page for r in engine._running for page in r.pages]
        shared += len(held) > len(set(held))
    while engine.has_unfinished():
        live -= {out.request_id for out in engine.step() if out.finished}
    assert not live and seen > 100
    assert engine.num_free_pages == total
    # Freed prompt pages stay cached (unused) for later requests until evicted.
    assert all(engine._pool.users(page) == 0 for page in engine._pool._hash_of)
    assert (engine._pool.num_cached > 0) == prefix_caching
    assert (shared > 10) == prefix_caching


@pytest.mark.slow  # ~2,000 requests, ~10,000 stubbed steps (~18 s)
def test_thousands_of_requests_keep_the_page_invariant_and_never_stall(tiny_llama, monkeypatch):
    """2,000+ requests (shared prefixes, aborts, stop tokens) through a small pool: after
    every step the free pages plus the distinct pages running requests hold are the pool
    (no leak, no double use), the queue keeps moving, and everything finishes."""
    rng = np.random.default_rng(3)
    engine = Engine(tiny_llama, num_pages=16, max_queue=8, **{**GEOMETRY, "prefill_tokens": 16})
    monkeypatch.setattr(engine_module, "model_step", _stub_step(8, rng, engine.step_shapes()))
    prefix, live, added, idle = rng.integers(0, 64, 16).tolist(), set(), 0, 0
    while added < 2000:
        for _ in range(int(rng.integers(0, 3))):
            with contextlib.suppress(QueueFull):
                live.add(engine.add_request(*_random_request(rng, prefix)))
                added += 1
        if rng.random() < 0.05 and live:
            engine.abort(int(rng.choice(sorted(live))))
        outputs = engine.step()
        live -= {out.request_id for out in outputs if out.finished}
        held = {page for r in engine._running for page in r.pages}
        assert engine.num_free_pages + len(held) == engine.num_total_pages
        idle = 0 if outputs or not engine._waiting else idle + 1
        assert idle < 5, "requests wait while nothing runs"
    for _ in range(500):
        if not engine.has_unfinished():
            break
        live -= {out.request_id for out in engine.step() if out.finished}
    assert not live and not engine.has_unfinished()
    assert engine.num_free_pages == engine.num_total_pages
    assert all(engine._pool.users(page) == 0 for page in engine._pool._hash_of)


def test_abort_frees_pages_at_once_and_reports_once(tiny_llama, monkeypatch):
    rng = np.random.default_rng(1)
    engine = Engine(tiny_llama, **GEOMETRY)
    monkeypatch.setattr(engine_module, "model_step", _stub_step(8, rng, engine.step_shapes()))
    rid = engine.add_request([1] * 9, SamplingParams(max_tokens=20))
    engine.step()
    assert engine.num_free_pages == engine.num_total_pages - 4
    engine.abort(rid)
    assert engine.num_free_pages == engine.num_total_pages
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    engine.abort(rid)  # gone: nothing more
    assert engine.step() == [] and not engine.has_unfinished()


@settings(max_examples=30)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=8),
    st.data(),
)
def test_page_pool_shares_prefixes_and_frees_with_the_last_user(prompts, data):
    pool = PagePool(64)
    held = []
    for prompt in prompts:
        hashes = block_hashes(prompt, 4)
        shared = pool.match(hashes)
        for page, h in zip(shared, hashes, strict=False):  # a hit is the same block
            assert pool._by_hash[h] == page
        own = pool.allocate(len(hashes) - len(shared) + 1)
        pages = shared + own
        for page, h in zip(pages, hashes, strict=False):
            pool.publish(page, h)
        held.append(pages)
        if data.draw(st.booleans()):
            pool.release(held.pop(data.draw(st.integers(0, len(held) - 1))))
    for pages in held:
        pool.release(pages)
    assert pool.num_free == 64 and len(pool._by_hash) == len(pool._hash_of) == pool.num_cached
    cached = pool.num_cached
    if cached:  # an unused cached page is matched again, and evicted last-released first
        first = next(iter(pool._unused_cached))
        assert pool.allocate(64 - cached + 1)[-1] == first and first not in pool._hash_of
    assert pool.num_cached == max(cached - 1, 0)


def test_warmup_and_first_use_of_each_shape_are_reported(tiny_llama, monkeypatch):
    """``echo`` hears every shape ``warmup`` compiles (n/total, elapsed, an estimate) and,
    serving, the first call of each shape a request waits on, once."""
    lines: list[str] = []
    engine = Engine(tiny_llama, echo=lines.append, **GEOMETRY)
    shapes = engine.step_shapes()
    monkeypatch.setattr(
        engine_module, "model_step", _stub_step(8, np.random.default_rng(0), shapes)
    )
    _run(engine, {0: [(_prompts(0, (5,))[0], SamplingParams(max_tokens=3))]})
    assert lines == [
        "compiling prefill 1x8, 4 pages (first use) ...",
        lines[1],
        "compiling decode 1x1, 4 pages (first use) ...",
        lines[3],
    ]
    assert lines[1].startswith("prefill 1x8, 4 pages ready in ")
    assert lines[3].startswith("decode 1x1, 4 pages ready in ") and lines[3].endswith("(compiled)")
    lines.clear()
    engine.warmup()  # the two programs used already are not compiled again
    assert len(lines) == len(engine.step_programs()) - 2 == 2 * len(shapes) - 2
    assert lines[0].startswith("compiled decode 2x1, 4 pages (1/6): ")
    assert lines[-1].startswith("compiled prefill 1x8, 4 pages, log-probs (6/6): ")
    assert " s so far, about " in lines[0] and lines[-1].endswith(" about 0 s left")
    assert engine_module.warmup_progress((4, 8, 16), 3, 12, 2.0, 6.0, cached=True) == (
        "loaded prefill 4x8, 16 pages (3/12): 2.0 s; 6 s so far, about 18 s left"
    )


def test_the_serving_step_holds_no_host_callback(tiny_llama, monkeypatch):
    """jax never writes a program with a host callback to its persistent compilation cache,
    so the step the engine compiles must hold none (the pages are checked on the host);
    a table too short for a row's tokens is refused on the host, naming the request."""
    texts: list[str] = []
    engine = Engine(tiny_llama, **GEOMETRY)
    stub = _stub_step(8, np.random.default_rng(0), engine.step_shapes())

    def spy(*args, **kw):  # lowered only: what it would compile, not run
        texts.append(model_step.lower(*args, **kw).as_text())
        return stub(*args, **kw)

    monkeypatch.setattr(engine_module, "model_step", spy)
    _run(engine, {0: [(_prompts(1, (3,))[0], SamplingParams(max_tokens=2))]})
    assert len(texts) == 2 and not any("callback" in text for text in texts)
    request = Request(7, (1, 2, 3), SamplingParams(max_tokens=2), 0, frozenset(), [])
    request.pages, request.computed = [0], 8
    with pytest.raises(RuntimeError, match="request 7 needs 2 pages for 8 \\+ 1 tokens"):
        check_pages(request, 1, 4, 8)


def _penalized_reference(model, jobs, max_new) -> list[list[int]]:
    """generate's greedy tokens for ``(prompt, params)`` jobs sharing one repetition
    penalty (generate's own), in one left-padded batch; each row's logit bias, then its
    presence / frequency penalties over its generated ids only (vLLM's formula), as a user
    processor (generate applies it after its repetition penalty: the jobs below with a
    bias have none, the engine adding the bias first)."""
    (penalty,) = {params.repetition_penalty for _, params in jobs}
    prompts = [prompt for prompt, _ in jobs]
    width, vocab, rows = max(map(len, prompts)), model.config.vocab_size, len(jobs)
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    presence = np.array([[params.presence_penalty] for _, params in jobs], np.float32)
    frequency = np.array([[params.frequency_penalty] for _, params in jobs], np.float32)
    bias = np.zeros((rows, vocab), np.float32)
    for i, (_, params) in enumerate(jobs):
        for token, value in params.logit_bias:
            bias[i, token] += value

    def processor(logits, tokens, valid):
        out = jnp.where(valid[:, width:], tokens[:, width:], vocab)
        counts = jnp.zeros(logits.shape, jnp.float32)
        counts = counts.at[jnp.arange(rows)[:, None], out].add(1.0, mode="drop")
        logits = logits + bias - frequency * counts
        return logits - presence * (counts > 0).astype(jnp.float32)

    out = generate(
        model,
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        repetition_penalty=penalty,
        logits_processor=processor,
    )
    return np.asarray(out.sequences[:, width:]).tolist()


@pytest.mark.slow  # three generate compiles for the references (~25-50 s on the 2-core VM)
def test_engine_penalties_and_logit_bias_match_generate_greedy(tiny_llama):
    """Greedy requests with penalties and a logit bias, in company of plain ones and
    reusing batch places (each place's penalty state starts again from its new prompt,
    prefix-cached pages too), give generate's tokens."""
    a, b, c = _prompts(3, (12, 9, 17))
    d = [*c[:16], 5]  # shares c's first two pages
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    settings = [
        dataclasses.replace(greedy, repetition_penalty=1.8),
        dataclasses.replace(greedy, presence_penalty=1.5, frequency_penalty=0.7),
        dataclasses.replace(greedy, repetition_penalty=0.6, frequency_penalty=-0.5),
        dataclasses.replace(greedy, logit_bias={7: 100.0, 3: -5.0}),
        dataclasses.replace(greedy, logit_bias=((9, 3.0),), presence_penalty=2.0),
    ]
    engine = Engine(tiny_llama, **GEOMETRY)
    jobs = [(a, settings[0]), (b, greedy), (c, settings[1]), (d, settings[2])]
    jobs += [(b, settings[3]), (a, settings[4]), (d, greedy), (c, settings[0])]
    got, _ = _run(engine, {2 * i: [job] for i, job in enumerate(jobs)})
    for penalty in {params.repetition_penalty for _, params in jobs}:
        index = [i for i, (_, p) in enumerate(jobs) if p.repetition_penalty == penalty]
        want = _penalized_reference(tiny_llama, [jobs[i] for i in index], MAX_TOKENS)
        assert [got[i] for i in index] == want, penalty
    plain = _greedy_reference(tiny_llama, [a, b], MAX_TOKENS)
    assert got[0] != plain[0] and got[1] == plain[1]  # the penalty changed a's tokens
    assert got[4] == [7] * MAX_TOKENS  # the +100 bias forces token 7
    with pytest.raises(ValueError, match=r"logit_bias ids \[999\] are not < 64"):
        engine.add_request(a, SamplingParams(logit_bias={999: 1.0}))
