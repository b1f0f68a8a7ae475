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


@pytest.mark.parametrize("prompt_len", [11, 14])  # drafts straddle the limit; the pending token
def test_speculative_decoding_equals_greedy_past_the_limit(models, prompt_len):
    """Prompt lookup on a repetitive prompt drafts several tokens a step, so verification
    chunks straddle the limit (from either side of it); the greedy tokens equal plain
    ``generate``'s, which re-runs the sequence at the limit."""
    _, model = models
    base = _prompt(4, 7)
    ids = np.tile(base, (1, 4))[:, :prompt_len]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    want = generate(model, ids, max_new_tokens=14, pad_token_id=0)
    out = generate(model, ids, max_new_tokens=14, pad_token_id=0, speculative=spec)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences))
    assert int(out.speculative.accepted[0]) > 0  # drafts were accepted, not just rejected


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
