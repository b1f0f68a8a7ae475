"""Log-probs (issue 47): ``edl.ops.logprobs.token_logprobs``, ``generate(..., logprobs=k)``,
the engine's per-token and prompt log-probs and lm-evaluation-harness's loglikelihood request
to ``edl serve``'s app, each against transformers' ``log_softmax`` of the model's float32
logits (1e-4), before any sampling processor."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.generate import generate
from edl.io.formats.hf import from_state_dict
from edl.ops.logprobs import token_logprobs
from edl.serve import Engine, SamplingParams
from edl.serve.step import model_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
GEOMETRY = dict(max_batch=4, max_model_len=32, page_size=8, prefill_chunk=8)


def _hf_and_edl(vocab: int = 64):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():  # peaked logits: top-k far from ties
            p.normal_(0.0, 0.25)
    return hf, from_state_dict(config.to_dict(), hf.state_dict())


@pytest.fixture(scope="module")
def models():
    return _hf_and_edl()


def hf_logprobs(hf, ids) -> np.ndarray:
    """``(len(ids), vocab)``: transformers' float32 log-softmax after each token of ``ids``."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_top(ids, values, ref_row, k):
    want = np.argsort(-ref_row, kind="stable")[:k]
    np.testing.assert_array_equal(ids[:k], want)
    np.testing.assert_allclose(values[:k], ref_row[want], atol=TOL)


def test_token_logprobs_is_torch_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 50)).astype(np.float32)
    tokens = np.array([0, 17, 49])
    chosen, ids, top = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 5)
    ref = torch.log_softmax(torch.tensor(logits), -1).numpy()
    np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], atol=1e-6)
    for row in range(3):
        _check_top(np.asarray(ids[row]), np.asarray(top[row]), ref[row], 5)
    empty = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 0)
    assert empty[1].shape == empty[2].shape == (3, 0)
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 20\], got 21"):
        token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 21)


@pytest.mark.slow  # three decode programs compiled (~20 s on the 2-core VM)
def test_generate_logprobs_equal_transformers_before_processors(models):
    hf, model = models
    ids = np.array([[0, 0, 5, 9, 12, 3], [7, 8, 9, 10, 11, 12]])
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int32)
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=5)
    assert plain.logprobs is None and plain.top_ids is None
    for kw in (dict(), dict(do_sample=True, temperature=0.5, top_k=3, key=jax.random.key(1))):
        out = generate(model, ids, attention_mask=mask, max_new_tokens=5, logprobs=4, **kw)
        if not kw:  # greedy stays token-exact
            np.testing.assert_array_equal(out.sequences, plain.sequences)
        assert out.logprobs.shape == (2, 5) and out.top_ids.shape == (2, 5, 4)
        for row in range(2):
            seq = [
                int(t) for t, m in zip(out.sequences[row], [*mask[row], *[1] * 5], strict=True) if m
            ]
            ref = hf_logprobs(hf, seq)
            start = int(mask[row].sum())
            for j in range(5):  # the raw distribution, not the tempered / top-k one
                at = ref[start - 1 + j]
                np.testing.assert_allclose(out.logprobs[row, j], at[seq[start + j]], atol=TOL)
                _check_top(
                    np.asarray(out.top_ids[row, j]), np.asarray(out.top_logprobs[row, j]), at, 4
                )
    with pytest.raises(ValueError, match="not reported by beam search"):
        generate(model, ids, max_new_tokens=2, num_beams=2, logprobs=1)
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got 21"):
        generate(model, ids, max_new_tokens=2, logprobs=21)


def _run(engine, requests):
    """Add ``(prompt, params)`` pairs, step until done; per request its tokens, log-prob
    entries and prompt log-probs."""
    ids = [engine.add_request(p, params) for p, params in requests]
    got = {i: ([], [], None) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, lps, _ = got[out.request_id]
            tokens += out.new_token_ids
            lps += out.logprobs or ()
            if out.prompt_logprobs is not None:
                assert got[out.request_id][2] is None, "prompt log-probs twice"
                got[out.request_id] = (tokens, lps, out.prompt_logprobs)
    return [got[i] for i in ids]


@pytest.mark.slow  # warms up both variants of four step shapes (~40 s on the 2-core VM)
def test_engine_logprobs_and_prompt_logprobs_equal_transformers(models):
    hf, model = models
    rng = np.random.default_rng(0)
    a = rng.integers(0, 64, 19).tolist()  # prefilled in 3 chunks of 8: targets cross them
    b = rng.integers(0, 64, 5).tolist()
    engine = Engine(model, **GEOMETRY)
    engine.warmup()  # both variants of every shape: nothing compiles below
    compiled = model_step._cache_size()
    asks = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    sampled = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=3, logprobs=0)
    (ta, la, pa), (_, lb, pb), (tc, lc, pc), (td, _, pd) = _run(
        engine,
        [
            (a, asks),
            (b, SamplingParams(max_tokens=4, temperature=0.0)),  # asks nothing: gets nothing
            (b, sampled),
            (a, SamplingParams(max_tokens=0, prompt_logprobs=0)),  # prompt only
        ],
    )
    assert model_step._cache_size() == compiled
    assert lb == [] and pb is None and pc is None and td == []
    for prompt, tokens, entries, k in ((a, ta, la, 3), (b, tc, lc, 0)):
        ref = hf_logprobs(hf, prompt + tokens)
        assert [e.token_id for e in entries] == tokens
        for j, e in enumerate(entries):
            at = ref[len(prompt) - 1 + j]
            np.testing.assert_allclose(e.logprob, at[tokens[j]], atol=TOL)
            assert len(e.top) == k
            if k:
                _check_top(*map(np.array, zip(*e.top, strict=True)), at, k)
    ref = hf_logprobs(hf, a)
    for got, k in ((pa, 2), (pd, 0)):
        assert len(got) == len(a) and got[0] is None
        for t in range(1, len(a)):
            assert got[t].token_id == a[t] and len(got[t].top) == k
            np.testing.assert_allclose(got[t].logprob, ref[t - 1, a[t]], atol=TOL)
            if k:
                _check_top(*map(np.array, zip(*got[t].top, strict=True)), ref[t - 1], k)
    assert engine.num_free_pages == engine.num_total_pages
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1 \(0 only with"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.slow  # a real engine behind edl serve's app, both step variants compiled (~15 s)
def test_lm_eval_loglikelihood_request_to_edl_serve_equals_transformers():
    """lm-evaluation-harness 0.4's ``local-completions`` loglikelihood request, verbatim
    (``LocalCompletionsAPI._create_payload(generate=False)``: token-id prompts, echo,
    logprobs 1, max_tokens 1) and its parsing (``parse_logprobs``: the sum of
    ``token_logprobs[ctxlen:-1]``, greedy if each equals its top); with ``max_tokens`` 0 the
    continuation is ``[ctxlen:]``."""
    uvicorn = pytest.importorskip("uvicorn")
    from edl.serve.server import create_app
    from edl.text import ByteTokenizer

    hf, model = _hf_and_edl(ByteTokenizer.vocab_size)
    engine = Engine(model, max_batch=4, max_model_len=64, page_size=8, prefill_chunk=16)
    app = create_app(engine, ByteTokenizer(), model_name="tiny", max_model_len=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"
    tok = ByteTokenizer()
    pairs = [("Question: 2+2=", " 4"), ("Question: 2+2=", " five"), ("The sky is", " blue")]
    inputs = [tok.encode(c) + tok.encode(x) for c, x in pairs]
    ctxlens = [len(tok.encode(c)) for c, _ in pairs]
    try:
        for max_tokens in (1, 0):
            payload = {
                "model": "tiny",
                "prompt": inputs,
                "temperature": 0,
                "max_tokens": max_tokens,
                "logprobs": 1,
                "seed": 1234,
                "echo": True,
            }
            out = _post(url, payload)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            assert len(choices) == len(inputs)
            for choice, ids, ctxlen in zip(choices, inputs, ctxlens, strict=True):
                lp = choice["logprobs"]
                assert choice["text"].startswith(tok.decode(ids))
                assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                assert len(lp["tokens"]) == len(ids) + max_tokens
                end = -1 if max_tokens else None
                got = sum(lp["token_logprobs"][ctxlen:end])
                ref = hf_logprobs(hf, ids)
                want = sum(ref[t - 1, ids[t]] for t in range(ctxlen, len(ids)))
                assert abs(got - want) < TOL
                greedy = all(
                    t == max(top.values())
                    for t, top in zip(
                        lp["token_logprobs"][ctxlen:end],
                        lp["top_logprobs"][ctxlen:end],
                        strict=True,
                    )
                )
                assert greedy == all(ref[t - 1].argmax() == ids[t] for t in range(ctxlen, len(ids)))
        assert engine.num_free_pages == engine.num_total_pages
    finally:
        server.should_exit = True
        thread.join(10)
