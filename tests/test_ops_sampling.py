"""edl.ops.sampling against transformers' logits processors (torch), plus sampling statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation import logits_process as hf

from edl.ops import sampling

BATCH, VOCAB, SEQ = 4, 50, 12
SEEDS = [0, 1, 2]


def random_logits(seed, scale=3.0, batch=BATCH, vocab=VOCAB, masked=True):
    """float32 logits, some already ``-inf`` (as after an earlier filter) when ``masked``."""
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((batch, vocab))).astype(np.float32)
    if masked:
        logits[rng.random((batch, vocab)) < 0.1] = -np.inf
    return logits


def random_tokens(seed, vocab=VOCAB):
    return np.random.default_rng(seed + 100).integers(0, vocab, (BATCH, SEQ), dtype=np.int32)


def edl_apply(processor, logits, tokens=None, valid=None):
    tokens = np.zeros((logits.shape[0], SEQ), np.int32) if tokens is None else tokens
    valid = np.ones(tokens.shape, bool) if valid is None else valid
    out = processor(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(valid))
    assert out.dtype == jnp.float32
    assert out.shape == logits.shape
    return np.asarray(out)


def hf_apply(processors, logits, tokens=None):
    tokens = np.zeros((logits.shape[0], SEQ), np.int64) if tokens is None else tokens
    scores, ids = torch.from_numpy(logits.copy()), torch.from_numpy(tokens.astype(np.int64))
    for processor in processors:
        scores = processor(ids, scores)
    return scores.numpy()


def assert_same(ours, theirs):
    """Identical ``-inf`` pattern; finite values equal to float32 rounding."""
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.5, 4.0])
def test_temperature_matches_hf(seed, t):
    logits = random_logits(seed)
    assert_same(
        edl_apply(sampling.temperature(t), logits),
        hf_apply([hf.TemperatureLogitsWarper(t)], logits),
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("k", "keep"), [(1, 1), (3, 1), (10, 1), (2, 5), (49, 1), (50, 1), (80, 1)]
)
def test_top_k_matches_hf(seed, k, keep):
    logits = random_logits(seed)
    assert_same(
        edl_apply(sampling.top_k(k, keep), logits),
        hf_apply([hf.TopKLogitsWarper(k, min_tokens_to_keep=keep)], logits),
    )


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_top_k_keeps_ties_like_hf(k):
    """Coarsely rounded logits tie at the k-th value: HF and edl both keep every tied token."""
    logits = np.round(random_logits(3, masked=False)).astype(np.float32)
    ours = edl_apply(sampling.top_k(k), logits)
    assert_same(ours, hf_apply([hf.TopKLogitsWarper(k)], logits))
    assert (np.isfinite(ours).sum(-1) >= k).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("p", "keep"), [(0.0, 1), (0.1, 1), (0.5, 1), (0.9, 1), (0.95, 3), (0.3, 4), (1.0, 1)]
)
def test_top_p_matches_hf(seed, p, keep):
    logits = random_logits(seed)
    assert_same(
        edl_apply(sampling.top_p(p, keep), logits),
        hf_apply([hf.TopPLogitsWarper(p, min_tokens_to_keep=keep)], logits),
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("p", "keep"), [(0.0, 1), (0.05, 1), (0.2, 1), (0.5, 2), (0.9, 3), (1.0, 1)]
)
def test_min_p_matches_hf(seed, p, keep):
    logits = random_logits(seed)
    assert_same(
        edl_apply(sampling.min_p(p, keep), logits),
        hf_apply([hf.MinPLogitsWarper(p, min_tokens_to_keep=keep)], logits),
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hf(seed, penalty):
    logits, tokens = random_logits(seed), random_tokens(seed)
    assert_same(
        edl_apply(sampling.repetition_penalty(penalty), logits, tokens),
        hf_apply([hf.RepetitionPenaltyLogitsProcessor(penalty)], logits, tokens),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_repetition_penalty_only_counts_valid_tokens(seed):
    """Row by row, edl with a ``valid`` mask equals HF on just that row's valid ids."""
    logits, tokens = random_logits(seed), random_tokens(seed)
    rng = np.random.default_rng(seed + 7)
    valid = rng.random(tokens.shape) < 0.5
    valid[0] = False  # a row with no history is left untouched
    tokens[~valid & (rng.random(tokens.shape) < 0.5)] = VOCAB + 3  # garbage in empty slots
    ours = edl_apply(sampling.repetition_penalty(1.7), logits, tokens, valid)
    for row in range(BATCH):
        ids = tokens[row][valid[row]][None]
        expected = hf_apply([hf.RepetitionPenaltyLogitsProcessor(1.7)], logits[row : row + 1], ids)
        assert_same(ours[row : row + 1], expected)
    assert_same(ours[0], logits[0])


def test_suppress_tokens_matches_hf():
    logits, ids = random_logits(0), [0, 7, 49, 60]  # 60 is beyond the vocab: ignored by both
    assert_same(
        edl_apply(sampling.suppress_tokens(ids), logits),
        hf_apply([hf.SuppressTokensLogitsProcessor(ids)], logits),
    )


def hf_chain(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None):
    """The sampling processors transformers' _get_logits_processor builds, in its order."""
    chain = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        chain.append(hf.RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature is not None and temperature != 1.0:
        chain.append(hf.TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        chain.append(hf.TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        chain.append(hf.TopPLogitsWarper(top_p))
    if min_p is not None:
        chain.append(hf.MinPLogitsWarper(min_p))
    return chain


CHAINS = [
    {},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 5, "top_p": 0.5, "repetition_penalty": 1.2},
    {"temperature": 0.5, "min_p": 0.1, "repetition_penalty": 0.8},
    {"top_p": 0.8, "min_p": 0.05},
    {"temperature": 2.0, "top_k": 30, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.5},
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kwargs", CHAINS)
def test_processors_for_matches_hf_chain(seed, kwargs):
    logits, tokens = random_logits(seed), random_tokens(seed)
    assert_same(
        edl_apply(sampling.processors_for(**kwargs), logits, tokens),
        hf_apply(hf_chain(**kwargs), logits, tokens),
    )


def test_no_op_values_give_the_identity():
    logits = random_logits(0)
    identity = sampling.processors_for(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    np.testing.assert_array_equal(edl_apply(identity, logits), logits)
    np.testing.assert_array_equal(edl_apply(sampling.compose(), logits), logits)


def test_compose_is_left_to_right():
    logits = random_logits(1, masked=False)
    # top-p renormalises over what survives, so the two orders keep different sets.
    a, b = sampling.top_p(0.5), sampling.top_k(3)
    ab = edl_apply(sampling.compose(a, b), logits)
    assert_same(ab, edl_apply(b, edl_apply(a, logits)))
    assert not np.array_equal(
        np.isfinite(ab), np.isfinite(edl_apply(sampling.compose(b, a), logits))
    )
    assert_same(edl_apply(sampling.compose(b, a), logits), edl_apply(a, edl_apply(b, logits)))


def test_processors_are_jittable():
    kwargs = CHAINS[-1]
    processor = sampling.processors_for(**kwargs)
    logits, tokens = random_logits(4), random_tokens(4)
    valid = np.ones(tokens.shape, bool)
    jitted = jax.jit(processor)(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(valid))
    assert_same(np.asarray(jitted), hf_apply(hf_chain(**kwargs), logits, tokens))

    @jax.jit
    def step(logits, tokens, valid, key):
        return sampling.sample(processor(logits, tokens, valid), key), sampling.greedy(logits)

    drawn, best = step(
        jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(0)
    )
    assert drawn.dtype == best.dtype == jnp.int32
    assert np.isfinite(np.asarray(jitted)[np.arange(BATCH), np.asarray(drawn)]).all()


def test_greedy_matches_torch_argmax_with_ties():
    logits = np.round(random_logits(5, scale=1.0)).astype(np.float32)  # many ties
    ours = np.asarray(sampling.greedy(jnp.asarray(logits)))
    np.testing.assert_array_equal(ours, torch.argmax(torch.from_numpy(logits), dim=-1).numpy())
    assert ours.dtype == np.int32


def test_sample_is_reproducible():
    logits = jnp.asarray(random_logits(6))
    keys = jax.random.split(jax.random.key(42), 16)
    draws = jax.vmap(sampling.sample, in_axes=(None, 0))(logits, keys)
    again = jax.vmap(sampling.sample, in_axes=(None, 0))(logits, keys)
    np.testing.assert_array_equal(draws, again)
    assert draws.shape == (16, BATCH)
    assert draws.dtype == jnp.int32
    assert len(np.unique(np.asarray(draws))) > 1  # different keys give different tokens


DRAWS = 20_000


def softmax64(x):
    z = np.exp(x.astype(np.float64) - x.max())
    return z / z.sum()


@pytest.mark.parametrize(
    "processor",
    [
        sampling.top_k(6),
        sampling.top_p(0.8),
        sampling.processors_for(temperature=0.8, top_k=9, top_p=0.95),
    ],
)
def test_sample_frequencies_match_softmax(processor):
    """Chi-square goodness of fit of 20000 seeded draws against softmax(processed logits)."""
    vocab = 12
    logits = random_logits(7, scale=1.0, batch=1, vocab=vocab, masked=False)
    processed = edl_apply(processor, logits)
    kept = np.isfinite(processed[0])
    assert 2 <= kept.sum() < vocab
    rows = jnp.broadcast_to(jnp.asarray(processed), (DRAWS, vocab))  # independent draws per row
    draws = np.asarray(sampling.sample(rows, jax.random.key(1234)))
    counts = np.bincount(draws, minlength=vocab)
    assert counts[~kept].sum() == 0  # filtered tokens are never drawn
    expected = DRAWS * softmax64(processed[0][kept])
    assert expected.min() > 5  # the chi-square approximation holds
    # Fixed key, so the p-value is deterministic; 1e-3 leaves a wide margin for a correct sampler.
    assert stats.chisquare(counts[kept], expected).pvalue > 1e-3
    # ... and the test has power: the unprocessed (or wrongly tempered) distribution is rejected.
    wrong = DRAWS * softmax64(processed[0][kept] / 0.7)
    assert stats.chisquare(counts[kept], wrong).pvalue < 1e-6


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sampling.temperature(0.0), "temperature must be a finite float > 0.*got 0.0"),
        (lambda: sampling.temperature(-1.0), "temperature.*got -1.0"),
        (lambda: sampling.temperature(float("nan")), "temperature.*got nan"),
        (lambda: sampling.temperature(float("inf")), "temperature.*got inf"),
        (lambda: sampling.top_k(0), "top_k must be a positive integer, got 0"),
        (lambda: sampling.top_k(-3), "top_k.*got -3"),
        (lambda: sampling.top_k(5, 0), "min_tokens_to_keep.*got 0"),
        (lambda: sampling.top_p(-0.1), r"top_p must be a float in \[0, 1\], got -0.1"),
        (lambda: sampling.top_p(1.5), "top_p.*got 1.5"),
        (lambda: sampling.top_p(0.5, 0), "min_tokens_to_keep.*got 0"),
        (lambda: sampling.min_p(1.01), "min_p.*got 1.01"),
        (lambda: sampling.min_p(-0.5), "min_p.*got -0.5"),
        (
            lambda: sampling.repetition_penalty(0.0),
            "repetition_penalty must be a float > 0, got 0.0",
        ),
        (lambda: sampling.suppress_tokens([3, -1]), "suppress_tokens.*got -1"),
        (lambda: sampling.processors_for(top_k=-1), "top_k.*got -1"),
        (lambda: sampling.processors_for(top_p=1.5), "top_p.*got 1.5"),
        (lambda: sampling.processors_for(temperature=0.0), "temperature.*got 0.0"),
        (lambda: sampling.processors_for(repetition_penalty=-2.0), "repetition_penalty.*-2.0"),
    ],
)
def test_bad_arguments_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# -- the per-row sampler (sample_rows / process_rows): every row its own settings ---------


def _row_settings(rows, bias_slots=4, **fields):
    """``RowSampling.off`` with ``fields`` (name -> per-row list) filled in, as jax arrays."""
    s = sampling.RowSampling.off(rows, bias_slots)
    for name, values in fields.items():
        getattr(s, name)[...] = np.asarray(values, getattr(s, name).dtype)
    return jax.tree.map(jnp.asarray, s)


# Per row: temperature, top_k, top_p, min_p, repetition, presence, frequency, logit bias.
ROWS = [
    (1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, {}),
    (0.7, 20, 0.9, 0.0, 1.3, 0.0, 0.0, {3: 5.0}),
    (1.3, 5, 0.5, 0.05, 0.8, 0.5, 0.25, {}),
    (0.5, 0, 1.0, 0.1, 1.0, -0.4, 1.5, {7: -100.0, 8: 2.5}),
    (2.0, 30, 0.95, 0.02, 1.5, 2.0, -2.0, {0: 1.0}),
]


def test_process_rows_equals_hf_processors_row_by_row():
    """Mixed settings in one batch, each row equal to HF's chain on that row alone: logit
    bias added first, HF's RepetitionPenalty over prompt + generated ids, vLLM's presence /
    frequency formula over generated ids only (written out here), then HF's temperature,
    top-k, top-p and min-p warpers."""
    rows = len(ROWS)
    logits = random_logits(11, batch=rows)
    rng = np.random.default_rng(12)
    prompt = rng.integers(0, VOCAB, (rows, 6))
    generated = rng.integers(0, VOCAB, (rows, 8))
    counts = np.stack([np.bincount(g, minlength=VOCAB) for g in generated]).astype(np.int32)
    seen = np.zeros((rows, VOCAB), bool)
    np.put_along_axis(seen, prompt, True, axis=1)
    t, k, p, mp, rep, pres, freq, bias = map(list, zip(*ROWS, strict=True))
    ids = np.full((rows, 4), -1, np.int32)
    values = np.zeros((rows, 4), np.float32)
    for i, b in enumerate(bias):
        ids[i, : len(b)], values[i, : len(b)] = list(b), list(b.values())
    s = _row_settings(
        rows,
        temperature=t,
        top_k=k,
        top_p_threshold=[1.0 - v for v in p],
        min_p=mp,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        bias_ids=ids,
        bias_values=values,
    )
    ours = np.asarray(
        jax.jit(sampling.process_rows)(
            jnp.asarray(logits), s, jnp.asarray(counts), jnp.asarray(seen)
        )
    )
    for i in range(rows):
        x = logits[i : i + 1].copy()
        for token, value in bias[i].items():
            x[0, token] += value
        history = np.concatenate([prompt[i], generated[i]])[None]
        x = hf_apply([hf.RepetitionPenaltyLogitsProcessor(rep[i])], x, history)
        x = x - pres[i] * (counts[i] > 0) - freq[i] * counts[i]  # vLLM's formula
        x = x.astype(np.float32)
        chain = [hf.TemperatureLogitsWarper(t[i])]
        chain += [hf.TopKLogitsWarper(k[i])] if k[i] else []
        chain += [hf.TopPLogitsWarper(p[i])] if p[i] < 1 else []
        chain += [hf.MinPLogitsWarper(mp[i])] if mp[i] > 0 else []
        assert_same(ours[i : i + 1], hf_apply(chain, x))
    assert np.isinf(ours[3, 7])  # a -100 bias leaves nothing of a token's chance


def test_sample_rows_greedy_rows_take_the_processed_argmax_and_bias_moves_it():
    logits = random_logits(13, batch=3, masked=False)
    best = logits.argmax(-1)
    second = np.argsort(logits, -1)[:, -2]
    worst = logits.argmin(-1)
    ids = np.full((3, 2), -1, np.int32)
    values = np.zeros((3, 2), np.float32)
    ids[1, 0], values[1, 0] = best[1], -100.0  # row 1: the best token banned
    ids[2, 0], values[2, 0] = worst[2], 100.0  # row 2: the worst token forced
    s = _row_settings(3, bias_slots=2, bias_ids=ids, bias_values=values, top_k=[1, 2, 3])
    tokens, logprobs = jax.jit(sampling.sample_rows)(jnp.asarray(logits), s)
    np.testing.assert_array_equal(np.asarray(tokens), [best[0], second[1], worst[2]])
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))  # the model's own log-probs
    np.testing.assert_allclose(np.asarray(logprobs), raw[np.arange(3), np.asarray(tokens)])


def test_sample_rows_draws_depend_on_seed_and_counter_not_on_the_row():
    logits = np.broadcast_to(random_logits(14, scale=0.5, batch=1, masked=False), (4, VOCAB))
    s = _row_settings(4, temperature=[1.0] * 4, seed=[5, 9, 5, 5], counter=[0, 0, 0, 1])
    tokens = np.asarray(jax.jit(sampling.sample_rows)(jnp.asarray(logits), s)[0])
    first = jnp.asarray(logits[:1])
    jitted = jax.jit(sampling.sample_rows)  # one compile for every seed below

    def draw(seed):
        s = _row_settings(1, temperature=[1.0], seed=[seed], counter=[0])
        return int(jitted(first, s)[0][0])

    assert tokens[0] == tokens[2] == draw(5)  # the same draw alone as in company
    draws = {draw(seed) for seed in range(20)}
    assert len(draws) > 3  # different seeds draw different tokens
