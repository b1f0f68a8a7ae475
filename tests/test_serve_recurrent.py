"""A model with recurrent states (Qwen3-Next's Gated DeltaNet) in the serving engine:
``edl.serve.state_slots``.

Default suite: the slots' gather / scatter (zeros at cache length 0, padding rows never
written) and the engine's bookkeeping with the model step replaced by a stub (a slot per
running request, reused after finish and abort, no prefix sharing, speculation refused),
and the recurrent step lowered for cuda and tpu from this host.
Slow set: greedy tokens of the real engine (several requests of different lengths, prompts
split over prefill chunks, more requests than batch places) equal transformers' on tiny
qwen3_next models built by transformers (dense and MoE, both layer kinds), and ``edl serve``
on a saved qwen3_next checkpoint through the official ``openai`` client.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.generate import SpeculativeConfig, generate
from edl.models import Qwen3NextConfig, Qwen3NextForCausalLM
from edl.serve import Engine, SamplingParams
from edl.serve import state_slots as slots_module
from edl.serve.state_slots import gather_rows, scatter_rows

VOCAB = 64


def _tiny_model(vocab: int = VOCAB) -> Qwen3NextForCausalLM:
    config = Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=0,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        max_position_embeddings=64,
    )
    return Qwen3NextForCausalLM.init(config, key=jax.random.key(0))


def _zero_model() -> Qwen3NextForCausalLM:
    """``_tiny_model``'s structure with zero weights, built without running its init
    (whose eager ops compile one by one: ~10 s on the shared VM), for the stub tests."""
    abstract = eqx.filter_eval_shape(_tiny_model)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s
    return jax.tree.map(zeros, abstract)


def test_gather_zeros_new_rows_and_scatter_drops_padding():
    pool = (jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2) + 1.0,)
    slots = jnp.asarray([2, 0, 3])  # slot 3: a padding row (out of range)
    lengths = jnp.asarray([5, 0, 0])  # row 1 starts a prompt in slot 0, which holds old data
    (rows,) = gather_rows(pool, slots, lengths)
    np.testing.assert_array_equal(rows[:, 0], pool[0][:, 2])
    np.testing.assert_array_equal(rows[:, 1:], 0.0)
    (after,) = scatter_rows(pool, slots, (rows + 10.0,))
    np.testing.assert_array_equal(after[:, 2], pool[0][:, 2] + 10.0)
    np.testing.assert_array_equal(after[:, 0], 10.0)
    np.testing.assert_array_equal(after[:, 1], pool[0][:, 1])  # no row: unchanged


def test_engine_gives_each_running_request_a_state_slot(monkeypatch):
    """Every call's real rows have distinct slots of the batch places and padding rows
    none; a request's first call starts at cache length 0 (zero states: no prefix pages are
    shared, even for equal prompts); slots come back at finish and abort."""
    calls = []

    def stub(model, k, v, pool, slots, table, lengths, tokens, num_new, targets=None, **kw):
        calls.append((np.asarray(slots), np.asarray(lengths), np.asarray(num_new)))
        return k, v, pool, jnp.zeros((tokens.shape[0], VOCAB)), None

    monkeypatch.setattr(slots_module, "state_model_step", stub)
    engine = Engine(_zero_model(), max_batch=2, max_model_len=32, page_size=4, prefill_chunk=4)
    assert not engine.prefix_caching  # asked for (the default), off for recurrent states
    prompt = list(range(3, 12))  # 9 tokens: three prefill chunks
    params = SamplingParams(max_tokens=3, temperature=0.0)
    ids = [engine.add_request(prompt, params) for _ in range(3)]
    engine.step()
    owned = {r.id: engine._states.slot_of(r.id) for r in engine._running}
    assert sorted(owned.values()) == [0, 1] and engine._states.num_free == 0
    engine.abort(ids[0])
    assert engine._states.num_free == 1
    while engine.has_unfinished():
        engine.step()
    assert engine._states.num_free == 2 and engine._pool.num_cached == 0
    starts = 0
    for slots, lengths, num_new in calls:
        real = num_new > 0
        assert len(set(slots[real])) == real.sum() and set(slots[real]) <= {0, 1}
        assert (slots[~real] == 2).all()
        starts += int(np.sum(real & (lengths == 0)))
    assert starts == 3  # each request computed from its first token, once


def test_speculation_is_refused_for_recurrent_models():
    """In the engine and in ``generate``: a rejected draft cannot leave a recurrent state."""
    model = _zero_model()
    with pytest.raises(ValueError, match=r"model with recurrent state.*qwen3_next"):
        Engine(model, max_batch=2, max_model_len=32, speculative=SpeculativeConfig())
    speculative = SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="recurrent"):
        generate(model, np.array([[5, 6, 7]]), max_new_tokens=2, speculative=speculative)


def _engine_tokens(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


@pytest.mark.slow  # transformers' models and the engine's step shapes (~40 s dense, ~50 s MoE)
@pytest.mark.parametrize("name", ["dense_tied", "moe_mixed"])
def test_engine_greedy_matches_transformers(name):
    """Four requests of 3 to 11 tokens on two batch places: prompts split over prefill
    chunks of 4 (two rows per prefill call), states carried from chunk to chunk and into
    decoding, the later requests waiting for a place and reusing a slot (zeroed)."""
    torch = pytest.importorskip("torch")
    from test_models_qwen3_next import VOCAB as HF_VOCAB
    from test_models_qwen3_next import _edl, _hf_model

    hf_model = _hf_model(name, seed=3, std=0.25)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, HF_VOCAB, n).tolist() for n in (3, 9, 6, 11)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf_model.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=6,
                pad_token_id=0,
                eos_token_id=None,
            )
            want.append(out[0, len(p) :].tolist())
    geometry = dict(max_batch=2, max_model_len=32, page_size=4, prefill_chunk=4)
    engine = Engine(_edl(hf_model), prefill_tokens=8, **geometry)
    assert _engine_tokens(engine, prompts, 6) == want
    assert engine.num_free_pages == engine.num_total_pages and engine._states.num_free == 2


@pytest.mark.slow  # edl serve's load and engine, step shapes compiled on first use (~60 s)
def test_edl_serve_on_a_qwen3_next_checkpoint_through_openai(tmp_path, monkeypatch):
    """``edl serve --model DIR`` of a saved qwen3_next model (no tokenizer files: the byte
    tokenizer), then the official client: greedy completions, plain and streamed, equal
    ``generate_text``'s (the contiguous cache, itself token-exact vs transformers)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import threading
    import time

    import edl.serve.server
    from edl.cli import main
    from edl.generate import generate_text
    from edl.io.formats.hf import save_pretrained
    from edl.text import ByteTokenizer

    tokenizer = ByteTokenizer()
    model = _tiny_model(tokenizer.vocab_size)
    save_pretrained(model, tmp_path / "m")
    apps = []
    monkeypatch.setattr(edl.serve.server, "serve", lambda app, **kw: apps.append(app))
    main(["serve", "--model", str(tmp_path / "m"), "--max-batch", "2", "--port", "0"])
    (app,) = apps
    server = edl.serve.server.make_server(app, port=0, drain_s=1.0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    name = str(tmp_path / "m")
    try:
        for prompt in ("Hello", "a longer prompt, over several pages"):
            want = generate_text(model, tokenizer, prompt, max_new_tokens=8)
            out = api.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == want
            chunks = api.completions.create(
                model=name, prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in chunks) == want
    finally:
        server.should_exit = True
        thread.join(10)


PAGED_KERNEL = {"cuda": "edl_paged_decode_attention", "tpu": "edl_tpu_paged_decode_attention"}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_state_model_step_lowers_for_accelerators(platform):
    """The engine's recurrent step lowered from this CPU host (abstract shapes): the
    platform's paged decode kernel in decode and prefill calls, and the delta rule's chunk
    scan kernel (Triton on GPUs, Mosaic on TPUs) in a prefill call; no native CPU kernel or
    host callback."""
    model = jax.eval_shape(lambda: _tiny_model().unstacked())
    pools = jax.ShapeDtypeStruct((1, 16, 16, 1, 8), jnp.float32)
    states = jax.eval_shape(lambda: model.model.init_states(4))
    row = jax.ShapeDtypeStruct((4,), jnp.int32)
    for width in (1, 16):
        args = (model, pools, pools, states, row, jax.ShapeDtypeStruct((4, 2), jnp.int32), row)
        args += (jax.ShapeDtypeStruct((4, width), jnp.int32), row)
        lowered = slots_module.state_model_step.trace(*args).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        assert PAGED_KERNEL[platform] in text, width
        scan = "edl_delta_rule_chunk_scan" in text
        assert scan == (platform == "cuda" and width > 1), width
        assert ("edl_tpu_delta_rule_fwd" in text) == (platform == "tpu" and width > 1), width
        assert not re.search(r"edl_paged_attention|python_cpu", text), width
