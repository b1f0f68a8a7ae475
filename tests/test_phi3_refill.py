"""Phi-3's LongRoPE refill past ``original_max_position_embeddings`` (16 here) on the paths
beside plain ``generate``: beam search (against transformers' beam search), speculative
decoding and the serving engine (against edl's greedy ``generate``, itself HF-exact).

transformers' Phi-3 drops its cache when a sequence first grows past the original context
and re-runs it whole, so every cached key is rotated by the long factors from then on; a
path that kept its short-factor keys would part from it a few tokens past the limit. The
long and short factors differ widely, so it does.
"""

import numpy as np
import pytest
from hf_parity import VOCAB, random_hf_model

from edl.generate import SpeculativeConfig, generate
from edl.io.formats import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ORIGINAL = 16


def _factors(n, low, high, seed):
    return np.random.default_rng(seed).uniform(low, high, n).tolist()


def _models():
    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": _factors(4, 1.0, 1.2, 0),
            "long_factor": _factors(4, 1.0, 8.0, 1),
        },
    )
    hf_model = random_hf_model(config, "causal_lm", seed=3, std=0.25)
    return hf_model, hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())


@pytest.fixture(scope="module")
def models():
    return _models()


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, (1, n))


@pytest.mark.slow  # transformers' and edl's beam search, compiled (~18 s)
def test_beam_search_refills_as_transformers(models):
    """Beams cross the original context at the 4th new token (prompt of 13); transformers'
    beam search re-runs every beam's sequence there with the long factors."""
    hf_model, model = models
    ids = np.concatenate([_prompt(13, 1), _prompt(13, 2)])
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, length_penalty=1.0)
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids), pad_token_id=0, eos_token_id=None, early_stopping=False, **kwargs
        )
    out = generate(model, ids, pad_token_id=0, eos_token_id=None, early_stopping=False, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref.numpy())


@pytest.mark.slow  # the speculative loop and generate, compiled (~24 s)
def test_speculative_decoding_equals_greedy_past_the_limit(models):
    """Prompt lookup on repetitive prompts drafts several tokens a step, so verification
    chunks straddle the limit; the greedy tokens equal plain ``generate``'s on each prompt
    alone (which re-runs the sequence at the limit), the rows of different lengths crossing
    it at different steps."""
    _, model = models
    rows = [np.tile(_prompt(4, 7), (1, 4))[0, :11], np.tile(_prompt(4, 8), (1, 4))[0, :14]]
    ids, mask = np.zeros((2, 14), np.int64), np.zeros((2, 14), np.int64)
    for row, prompt in enumerate(rows):  # left-padded, as generate takes a batch
        ids[row, 14 - len(prompt) :], mask[row, 14 - len(prompt) :] = prompt, 1
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0, speculative=spec
    )
    for row, prompt in enumerate(rows):
        want = generate(model, prompt[None], max_new_tokens=14, pad_token_id=0)
        np.testing.assert_array_equal(
            np.asarray(out.sequences)[row, 14:], np.asarray(want.sequences)[0, len(prompt) :]
        )
    assert np.all(np.asarray(out.speculative.accepted) > 0)  # drafts were accepted


def test_rope_min_length_gives_a_chunk_the_whole_sequences_factors():
    """A prefill chunk at positions 0..3 of a 20-token sequence reads the long factors (the
    length at least 20), a row without a floor its own length's short ones."""
    import jax.numpy as jnp

    from edl.ops.rope import RopeConfig, rope_tables

    config = RopeConfig(
        dim=8,
        rope_type="longrope",
        original_max_position_embeddings=ORIGINAL,
        factor=4.0,
        short_factor=(1.0, 1.1, 1.2, 1.3),
        long_factor=(1.0, 3.0, 5.0, 7.0),
    )
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    floor = jnp.array([20, 0], jnp.int32)
    cos, sin = rope_tables(positions, config, per_row=True, min_length=floor)
    long = rope_tables(positions.at[:, -1].set(19), config, per_row=True)  # length 20
    short = rope_tables(positions, config, per_row=True)
    np.testing.assert_array_equal(cos[0, :3], long[0][0, :3])
    np.testing.assert_array_equal(sin[1], short[1][1])
    assert not np.allclose(cos[0], short[0][0])


def test_engine_refill_plan():
    """The host side of the engine's refill (``edl.serve.refill``)."""
    from edl.serve import SamplingParams, refill
    from edl.serve.requests import Request

    assert refill.may_share(None, 40, 40)
    assert refill.may_share(16, 12, 5) and not refill.may_share(16, 12, 6)  # feeds position 16
    assert not refill.may_share(16, 17, 1)  # its prompt is past the limit
    r = Request(0, tuple(range(3, 15)), SamplingParams(max_tokens=9), 0, frozenset(), [])
    r.pages, r.computed, r.generated = [7, 3, 5, 9, 2], 13, [20, 21]  # 12 + 2 - the pending
    drafts = [np.arange(4), np.arange(2)]
    other = Request(1, (3, 4), SamplingParams(max_tokens=9), 0, frozenset(), [])
    other.computed = 16
    assert [list(d) for d in refill.cap_drafts(16, [r, other], drafts)] == [[0, 1], [0, 1]]
    assert refill.cap_drafts(16, [r], [np.arange(4)]) is not None
    r.computed = 15
    assert refill.cap_drafts(16, [r], [np.arange(4)]) is None  # its pending token alone
    assert refill.crossing(16, [r, other]) == [other] and refill.crossing(None, [other]) == []
    r.computed, r.generated = 16, [20, 21, 22, 23, 24]
    chunks = list(refill.refill_chunks(r, 16, 8, 4, (8,), (1, 4, 5)))
    assert [(t.shape, int(n[0]), int(at[0])) for t, n, at, _ in chunks] == [
        ((1, 8), 8, 0),
        ((1, 8), 8, 8),
    ]
    np.testing.assert_array_equal(chunks[1][0][0], [11, 12, 13, 14, 20, 21, 22, 23])
    np.testing.assert_array_equal(chunks[0][3], [[7, 3, 5, 9]])
    floor = refill.rope_floor(16, [r, Request(2, (5,) * 30, r.params, 0, frozenset(), [])], 4)
    np.testing.assert_array_equal(floor, [0, 30, 0, 0])
    assert refill.rope_floor(None, [r], 1) is None
    r.computed = 15
    with pytest.raises(RuntimeError, match="request 0 holds 15 tokens"):
        list(refill.refill_chunks(r, 16, 8, 4, (8,), (4,)))


def _engine_tokens(engine, prompts, max_tokens):
    from edl.serve import SamplingParams

    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def _assert_engine_equals_generate(model, engine, prompts, max_tokens):
    got = _engine_tokens(engine, prompts, max_tokens)
    for prompt, n, tokens in zip(prompts, max_tokens, got, strict=True):
        want = generate(model, np.array([prompt]), max_new_tokens=n, pad_token_id=0)
        assert tokens == np.asarray(want.sequences)[0, len(prompt) :].tolist(), len(prompt)


CROSSING = [int(t) for t in _prompt(13, 11)[0]]  # 13 tokens + 12: crosses at position 16


@pytest.mark.slow  # the engine's step shapes compile, six generate calls (~60 s)
def test_engine_refills_a_request_crossing_the_limit(models):
    """First a request inside the limit, whose prompt pages go to the prefix cache; then, in
    one batch, a request sharing its first two pages that crosses the limit while decoding
    (re-run through its own pages in chunks of 8, the cached ones untouched), one whose
    prompt is past the limit from the start (its first prefill chunks must read the long
    factors) and one inside it; last, the first prompt again, from the cached pages."""
    from edl.serve import Engine

    _, model = models
    engine = Engine(model, max_batch=4, max_model_len=32, page_size=4, prefill_chunk=8)
    inside = [*CROSSING[:8], 60, 61, 62]
    past = [int(t) for t in _prompt(19, 4)[0]]
    _assert_engine_equals_generate(model, engine, [inside], [4])
    batch = [[*CROSSING[:8], *CROSSING[8:]], past, [5, 6, 7]]
    _assert_engine_equals_generate(model, engine, batch, [12, 5, 6])
    _assert_engine_equals_generate(model, engine, [inside], [4])


@pytest.mark.slow  # the engine's and its draft's shapes compile (~60 s)
def test_engine_speculation_stops_at_the_limit(models):
    """The target drafting for itself proposes its own greedy tokens, so a 13-token prompt's
    first verification (positions 13..17) would straddle the limit; the engine cuts it there
    and refills, and its greedy tokens equal ``generate``'s (uncut, they part at the 5th)."""
    from edl.serve import Engine

    _, model = models
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=4)
    engine = Engine(
        model,
        max_batch=2,
        max_model_len=32,
        page_size=4,
        prefill_chunk=8,
        speculative=spec,
        draft_model=model,
    )
    prompts = [CROSSING, [int(t) for t in _prompt(14, 13)[0]]]
    _assert_engine_equals_generate(model, engine, prompts, [12, 12])
    assert engine.speculation_counts[1] > 0  # drafts were accepted
