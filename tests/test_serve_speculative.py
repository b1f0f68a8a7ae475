"""Speculative decoding in the serving engine (edl.serve.speculation): prompt lookup drafts
verified in the decode call. Greedy output equals the engine's own plain greedy output token
for token (stop tokens and ``max_tokens`` inside accepted runs too), every page comes back,
seeded sampling keeps the target's distribution, and the counters / flags reach ``/metrics``
and ``edl serve``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edl._settings import ConfigError
from edl.generate import SpeculativeConfig
from edl.generate.ngram import propose_ngram
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.serve import Engine, SamplingParams
from edl.serve.driver import Stats
from edl.serve.metrics import ServerMetrics
from edl.serve.requests import Request
from edl.serve.sampler import row_settings
from edl.serve.speculation import Speculation, propose_ngram_host, verify_step

VOCAB = 64
GEOMETRY = dict(max_batch=4, max_model_len=64, page_size=8, prefill_chunk=16)
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def _model(seed=0, layers=2, vocab=VOCAB, scale=2.0):
    """A tiny Llama whose weights are scaled up: peaked logits, argmax far from ties; at
    scale 2 its greedy continuations fall into short cycles, which prompt lookup drafts."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(seed))
    return jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, model)


@pytest.fixture(scope="module")
def target():
    return _model()


def _run(engine: Engine, jobs):
    """Add every ``(prompt, params)`` at once, step until done; returns per request its
    tokens, finish reason and the sizes of its outputs. Every page is free at the end."""
    ids = [engine.add_request(prompt, params) for prompt, params in jobs]
    tokens, reasons, chunks = {i: [] for i in ids}, {}, {i: [] for i in ids}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in reasons, "output after finishing"
            tokens[out.request_id] += out.new_token_ids
            chunks[out.request_id].append(len(out.new_token_ids))
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not engine.has_unfinished(), "the engine does not finish"
    assert engine.num_free_pages == engine.num_total_pages  # every page came back
    return [tokens[i] for i in ids], [reasons[i] for i in ids], [chunks[i] for i in ids]


def test_host_prompt_lookup_equals_generates_rule():
    """``propose_ngram_host`` (numpy, the engine's) and ``propose_ngram`` (jnp,
    ``generate``'s) draft the same tokens: random sequences over small vocabularies (many
    matches), every length from 1 to 23, several k and n bounds."""
    rng = np.random.default_rng(0)
    for k, low, high in [(1, 1, 1), (3, 1, 3), (4, 2, 3), (5, 1, 2), (2, 3, 4)]:
        rows, width = 64, 24
        lengths = rng.integers(1, width, rows)
        seqs = rng.integers(0, rng.integers(2, 6, rows)[:, None], (rows, width))
        drafts, valid = propose_ngram(jnp.asarray(seqs), jnp.asarray(lengths), k, low, high)
        drafts, valid = np.asarray(drafts), np.asarray(valid)
        for row, (seq, length) in enumerate(zip(seqs, lengths, strict=True)):
            got = propose_ngram_host(seq[:length], k, low, high)
            np.testing.assert_array_equal(
                got, drafts[row][valid[row]], err_msg=f"{seq[:length]}, {k, low, high}"
            )


@pytest.fixture(scope="module")
def copying_prompts(target):
    """Prompts of different lengths that copy: a random start, its greedy continuation
    (12 tokens, as the plain engine decodes it), the start again; the target then repeats
    much of what it said, so prompt lookup's drafts get accepted."""
    rng = np.random.default_rng(1)
    starts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 6, 9, 5, 7)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    own, _, _ = _run(Engine(target, **GEOMETRY), [(s, greedy) for s in starts])
    return [s + o + s for s, o in zip(starts, own, strict=True)]


def _greedy(max_tokens, stop=()):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)


def _runs(tokens, sizes):
    """``(start, size, new)`` of each verified run (an output of several tokens); ``new``:
    its first token, an accepted draft, was not generated before."""
    starts = np.cumsum([0, *sizes[:-1]])
    return [
        (int(s), n, tokens[s] not in tokens[:s])
        for s, n in zip(starts, sizes, strict=True)
        if n >= 2
    ]


@pytest.mark.gpu  # what a GPU run must check (benchmarks/device/run.sh)
def test_speculative_greedy_equals_plain_greedy_with_stops_and_lengths(target, copying_prompts):
    """Five requests of different lengths (four admitted at once, the fifth when one ends):
    token for token and reason for reason equal to the engine without speculation, with
    drafts accepted. Then again with a stop token that first appears as an accepted draft
    inside a verified run, and a ``max_tokens`` that ends inside one."""
    jobs = [(p, _greedy(12)) for p in copying_prompts]
    engine = Engine(target, speculative=SPEC, **GEOMETRY)
    got, reasons, chunks = _run(engine, jobs)
    want, want_reasons, _ = _run(Engine(target, **GEOMETRY), jobs)
    assert got == want and reasons == want_reasons
    drafted, accepted = engine.speculation_counts
    assert 0 < accepted <= drafted
    assert max(max(c) for c in chunks) == SPEC.num_speculative_tokens + 1  # all k accepted
    runs = [(i, *run) for i, t in enumerate(got) for run in _runs(t, chunks[i])]
    i, start, _, _ = next(r for r in runs if r[3])
    j, start_j, size_j, _ = next(r for r in runs if r[0] != i and r[2] >= 3)
    jobs[i] = (copying_prompts[i], _greedy(12, (got[i][start],)))
    jobs[j] = (copying_prompts[j], _greedy(start_j + size_j - 1))
    got, reasons, _ = _run(Engine(target, speculative=SPEC, **GEOMETRY), jobs)
    want, want_reasons, _ = _run(Engine(target, **GEOMETRY), jobs)
    assert got == want and reasons == want_reasons
    assert (len(got[i]), reasons[i]) == (start + 1, "stop")
    assert (len(got[j]), reasons[j]) == (start_j + size_j - 1, "length")


@pytest.mark.slow  # ~8 s; the greedy-equality test checks speculating rows by default
def test_rows_that_cannot_speculate_decode_one_token_in_the_same_call(target, copying_prompts):
    """A penalized request and one asking for log-probs run beside a speculating one: they
    get one token per output and equal their own plain decoding; the verification shapes
    are among the engine's step shapes."""
    prompt = copying_prompts[2]
    jobs = [
        (prompt, _greedy(10)),
        (prompt, SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3)),
        (prompt, SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)),
    ]
    want, _, _ = _run(Engine(target, **GEOMETRY), jobs)
    engine = Engine(target, speculative=SPEC, **GEOMETRY)
    shapes = set(engine.step_shapes())
    assert {(r, 4, p) for r in engine.row_buckets for p in engine.page_buckets} <= shapes
    got, _, chunks = _run(engine, jobs)
    assert got == want
    assert max(chunks[0]) > 1 and set(chunks[1]) == set(chunks[2]) == {1}


@pytest.mark.slow  # ~6 s on an idle 2-core machine (five programs compiled)
def test_warmup_compiles_the_verification_shapes(target, copying_prompts):
    """``warmup`` compiles the verification programs (named ``verify RxW``) and sampler
    too, so serving a speculating request compiles nothing more (one row, one page bucket:
    decode and prefill with and without log-probs, and one verification program)."""
    lines: list[str] = []
    geometry = dict(max_batch=1, max_model_len=64, page_size=64, prefill_chunk=16)
    engine = Engine(target, speculative=SPEC, echo=lines.append, **geometry)
    assert engine.step_programs()[-1] == (1, 4, 1, False, True)
    engine.warmup()
    assert len(lines) == len(engine.step_programs()) == 5
    assert lines[-1].startswith(("compiled verify 1x4, 1 pages (5/5)", "loaded verify 1x4"))
    lines.clear()
    _run(engine, [(copying_prompts[2], _greedy(12))])
    assert engine.speculation_counts[1] > 0 and lines == []


def test_a_request_whose_drafts_are_rejected_backs_off(target):
    """All drafts rejected: the request drafts nothing for 1, then 2, then 4, ... steps;
    an accepted draft ends the pause at once."""
    spec = Speculation(SPEC, target)
    request = Request(0, (5, 6, 7, 5, 6), _greedy(40), 0, frozenset(), [])
    request.generated = [7]  # 5 6 7 5 6 7: drafts 5 6 7

    def step(accept: bool) -> bool:
        drafts = spec.drafts([request])
        if drafts is not None:
            choice = drafts[0][0] if accept else 0  # the target's argmax at every position
            logits = jax.nn.one_hot(jnp.full((1, SPEC.num_speculative_tokens + 1), choice), VOCAB)
            assert (spec.verify(logits, [request], drafts)[0][2] > 0) == accept
        return drafts is not None

    drafted = [step(accept=False) for _ in range(12)]
    assert drafted == [True, False, True, False, False, True, *[False] * 4, True, False]
    assert [step(accept=True) for _ in range(8)] == [False] * 7 + [True]
    assert step(accept=True) and step(accept=True)


def _exact_marginals(model, prompt, vocab):
    """The target's exact distributions of the 1st and 2nd generated tokens."""

    def next_probs(seqs):
        out = model.model(jnp.asarray(seqs))
        return np.asarray(jax.nn.softmax(model.lm_logits(out.last_hidden_state[:, -1]), -1))

    p1 = next_probs(np.asarray(prompt)[None])[0]
    p2_given = next_probs(np.array([[*prompt, a] for a in range(vocab)]))
    return p1, (p1[:, None] * p2_given).sum(0)


@pytest.mark.gpu  # what a GPU run must check (benchmarks/device/run.sh)
@pytest.mark.slow  # ~9 s on an idle 2-core machine (1024 requests in one batch)
def test_speculative_sampling_keeps_the_target_distribution():
    """1024 seeded requests of one prompt in one batch, vocab 8, temperature 1: the prompt
    holds every token, so each request drafts after its first token and its 2nd token comes
    from a verification (accepted draft or rejection-rule draw). Its empirical distribution
    must be the target's exact marginal: total variation noise with 1024 draws over 8 cells
    averages ~0.033 (sum over cells of sqrt(2 p (1 - p) / (pi n)) / 2); the bound is 3x
    that. Accepting every draft would give TV 0.23 here (checked below, so the bound has
    the power to fail)."""
    vocab, rows = 8, 1024
    model = _model(seed=3, layers=2, vocab=vocab, scale=2.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 3, 1]
    geometry = dict(max_batch=rows, max_model_len=16, page_size=8, prefill_chunk=16)
    engine = Engine(model, prefill_tokens=16 * rows, max_queue=rows, speculative=SPEC, **geometry)
    jobs = [(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=i)) for i in range(rows)]
    tokens, _, _ = _run(engine, jobs)
    drafted, accepted = engine.speculation_counts
    assert drafted >= rows and 0 < accepted < drafted  # both verdicts happened
    p1, p2 = _exact_marginals(model, prompt, vocab)
    second = np.bincount([t[1] for t in tokens], minlength=vocab) / rows
    assert 0.5 * np.abs(second - p2).sum() < 0.1
    # Accepting every draft: the token after the first token's earliest occurrence in the
    # prompt (a 1-gram lookup: no longer n-gram recurs), weighted by p1.
    always = np.zeros(vocab)
    for a in range(vocab):
        always[propose_ngram_host([*prompt, a], 1, 1, 3)[0]] += p1[a]
    assert 0.5 * np.abs(always - p2).sum() > 0.2


def test_verification_samples_each_rows_processed_distribution():
    """``verify_step`` alone, 20k rows of the same logits with per-row seeds and a point-mass
    draft: the first emitted token is distributed as the row's *processed* target
    distribution (temperature 0.7, top-k 5; logit bias +3 on one id), whatever the draft,
    and a row draws the same tokens in a batch of 8;
    accepting the draft always would put 1 - p(draft) = 0.6+ of mass in the wrong place.
    Noise ~0.006 TV over 8 cells at 20k draws; bound 0.03. Greedy rows take the argmax."""
    vocab, k, rows = 8, 2, 20_000
    logits = 1.5 * jax.random.normal(jax.random.key(2), (k + 1, vocab))
    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={3: 3.0})
    sampling = row_settings(rows, [(params, seed, 4) for seed in range(rows)])
    scaled = (logits[0].at[3].add(3.0) / 0.7).tolist()
    kept = np.argsort(scaled)[-5:]
    p = np.zeros(vocab)
    p[kept] = np.exp(np.asarray(scaled)[kept] - max(scaled))
    p /= p.sum()
    draft = int(np.argsort(p)[-2])  # a likely token, not the likeliest
    drafts = np.full((rows, k), draft, np.int32)
    valid = np.ones((rows, k), bool)
    batch = jnp.broadcast_to(logits, (rows, k + 1, vocab))
    accepted, emitted, _ = verify_step(batch, sampling, drafts, valid)
    first = np.bincount(np.asarray(emitted[:, 0]), minlength=vocab) / rows
    assert 0.5 * np.abs(first - p).sum() < 0.03
    assert 0 < float(np.mean(np.asarray(accepted) > 0)) < 1 and p[draft] < 0.4
    # A row's draws depend on its seed and count alone, not on the batch it runs in.
    part = jax.tree.map(lambda x: x[100:108], sampling)
    _, alone, _ = verify_step(batch[:8], part, drafts[:8], valid[:8])
    np.testing.assert_array_equal(alone, emitted[100:108])
    greedy = row_settings(2, [(SamplingParams(temperature=0.0), 0, 0)] * 2)
    accepted, emitted, _ = verify_step(batch[:2], greedy, drafts[:2], valid[:2])
    best = int(jnp.argmax(logits[0]))
    assert emitted[0, 0] == best and int(accepted[0]) == (draft == best)


def test_engine_speculation_errors_name_the_problem(target):
    with pytest.raises(ValueError, match="'draft' needs draft_model="):
        Engine(target, speculative=SpeculativeConfig(method="draft"), **GEOMETRY)
    with pytest.raises(ValueError, match="'ngram' takes no draft_model"):
        Engine(target, speculative=SPEC, draft_model=target, **GEOMETRY)
    small = _model(vocab=32, layers=1)
    with pytest.raises(ValueError, match="draft model's vocab_size 32 differs"):
        Engine(
            target,
            speculative=SpeculativeConfig(method="draft"),
            draft_model=small,
            **GEOMETRY,
        )


DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3)


def _draft_jobs(copying_prompts):
    # Four at once, then a fifth sharing the first's prompt pages (published by then).
    prompts = [*copying_prompts[:4], [*copying_prompts[0], 5, 6]]
    return [(p, _greedy(11)) for p in prompts]


@pytest.mark.slow  # ~9 s (a second model compiled); prompt lookup runs by default
def test_draft_model_greedy_equals_plain_greedy(target, copying_prompts):
    """A draft model in the engine, the target itself: every draft is accepted (so the
    draft cache lags by two after each verification and catches up with a two-token call);
    greedy output equals the engine's plain greedy output token for token, prompts sharing
    cached prefix pages (the draft reads its own pools through the shared pages), and every
    page comes back."""
    jobs = _draft_jobs(copying_prompts)
    want, want_reasons, _ = _run(Engine(target, **GEOMETRY), jobs)
    same = Engine(target, speculative=DRAFT, draft_model=target, **GEOMETRY)
    got, reasons, chunks = _run(same, jobs)
    assert got == want and reasons == want_reasons
    drafted, accepted = same.speculation_counts
    assert accepted == drafted > 0  # the target drafting for itself: all accepted
    assert max(max(c) for c in chunks) == DRAFT.num_speculative_tokens + 1


@pytest.mark.slow  # ~15 s on an idle 2-core machine (a second model's programs)
def test_another_draft_model_keeps_greedy_output(target, copying_prompts):
    """A draft model of another depth and weights: few drafts accepted, the output still the
    plain engine's token for token."""
    jobs = _draft_jobs(copying_prompts)
    want, want_reasons, _ = _run(Engine(target, **GEOMETRY), jobs)
    other = Engine(target, speculative=DRAFT, draft_model=_model(seed=3, layers=1), **GEOMETRY)
    got, reasons, _ = _run(other, jobs)
    assert got == want and reasons == want_reasons
    drafted, accepted = other.speculation_counts
    assert drafted > 0 and accepted < drafted


def _samples(text: str) -> dict[str, float]:
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_metrics_report_vllms_speculative_counters():
    stats = Stats(running=1, spec_drafted=40, spec_accepted=25)
    got = _samples(ServerMetrics(lambda: stats).render().decode())
    assert got["edl:spec_decode_num_draft_tokens_total"] == 40
    assert got["edl:spec_decode_num_accepted_tokens_total"] == 25
    plain = _samples(ServerMetrics(lambda: Stats()).render().decode())
    assert "edl:spec_decode_num_draft_tokens_total" not in plain


def test_serve_flags_build_the_speculative_config(monkeypatch, capsys):
    from edl.cli import _check_serve, _parser, main

    def parsed(*argv):
        args = _parser().parse_args(["serve", "--model", "m", *argv])
        _check_serve(args)
        return args.speculative

    assert parsed() is None
    assert parsed("--speculative-method", "ngram", "--num-speculative-tokens", "5") == (
        SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    )
    with pytest.raises(ConfigError, match="--prompt-lookup-max: needs --speculative-method"):
        parsed("--prompt-lookup-max", "4")
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--speculative-method", "eagle"])
    assert "got 'eagle'" in capsys.readouterr().err
    assert parsed("--speculative-method", "draft", "--draft-model", "small").method == "draft"
    for argv in (["--speculative-method", "draft"], ["--draft-model", "small"]):
        with pytest.raises(ConfigError, match="--draft-model: needed by --speculative-method"):
            parsed(*argv)
