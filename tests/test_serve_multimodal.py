"""The serving engine and ``edl serve`` on a vision-language model (Gemma 3's ``gemma3``,
LLaVA): text requests run through its language model (``edl.serve.multimodal.text_model``),
greedy tokens equal to ``edl.generate`` on the multimodal model; chat messages with image
parts are 400s saying images are not served.

The tiny model: ``tests/test_models_gemma3_vision.py``'s Gemma 3 (a SigLIP tower of 4 x 4
patches pooled to 4 image tokens, one sliding and one full text layer), built by edl from
its HF config (no transformers), with the byte tokenizer's 259 tokens.
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import threading
import time
import types

import equinox as eqx
import jax
import numpy as np
import pytest
from serve_fakes import ChatBytes

from edl.generate import generate
from edl.models.gemma3_vision import Gemma3Config, Gemma3ForConditionalGeneration
from edl.models.llava import LlavaConfig, LlavaForConditionalGeneration
from edl.serve import Engine, SamplingParams
from edl.serve.messages import chat_turns
from edl.serve.multimodal import text_model
from edl.serve.structured import FieldError

HF_CONFIG = dict(
    model_type="gemma3",
    mm_tokens_per_image=4,
    image_token_index=255,
    boi_token_index=253,
    eoi_token_index=254,
    text_config=dict(
        model_type="gemma3_text",
        vocab_size=259,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=3,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    ),
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=24,
        intermediate_size=30,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    ),
)

KEY = jax.random.key(0)
LLAVA = dict(
    model_type="llava",
    image_token_index=60,
    image_seq_length=4,
    text_config=dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    vision_config=dict(
        model_type="clip_vision_model",
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    ),
)


def _shapes():
    """The tiny Gemma 3's pytree of ``jax.ShapeDtypeStruct`` leaves (nothing computed)."""
    config = Gemma3Config.from_hf(HF_CONFIG)
    return eqx.filter_eval_shape(Gemma3ForConditionalGeneration.init, config, key=KEY)


@pytest.fixture(scope="module")
def gemma3():
    """Every weight drawn from N(0, 0.2), as the parity tests draw them, in one compiled
    program (the eager init takes ~15 s; this ~8 s: slow tests only)."""
    leaves, treedef = jax.tree.flatten(_shapes())

    @jax.jit
    def draw(key):
        keys = jax.random.split(key, len(leaves))
        return [
            0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
        ]

    return jax.tree.unflatten(treedef, draw(jax.random.key(1)))


def test_text_model_is_the_language_model_of_a_vision_language_model():
    gemma3 = _shapes()
    lm = text_model(gemma3)
    assert type(lm).__name__ == "Gemma3ForCausalLM"
    assert lm.model is gemma3.model.language_model  # the same arrays, no copy
    assert text_model(lm) is lm  # a causal LM as it is
    llava = eqx.filter_eval_shape(
        LlavaForConditionalGeneration.init, LlavaConfig.from_hf(LLAVA), key=KEY
    )
    assert type(text_model(llava)).__name__ == "LlamaForCausalLM"


@pytest.mark.slow  # the weights drawn, the engine's and generate's programs compiled (~17 s)
def test_engine_greedy_on_gemma3_multimodal_equals_generate(gemma3):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (7, 4)]
    engine = Engine(gemma3, max_batch=2, max_model_len=32, page_size=8, prefill_chunk=8)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [engine.add_request(p, greedy) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for i, prompt in zip(ids, prompts, strict=True):
        out = generate(gemma3, np.array([prompt]), max_new_tokens=6, do_sample=False)
        assert tokens[i] == np.asarray(out.sequences[0, len(prompt) :]).tolist()


def test_image_parts_are_refused_saying_images_are_not_served():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
    with pytest.raises(FieldError, match=r"messages\[0\]\.content\[1\]: image parts") as caught:
        chat_turns([message])
    assert "not served" in str(caught.value)
    assert caught.value.param == "messages[0].content"


def _serve_main(directory, monkeypatch, engine=None):
    """``edl serve`` on ``directory`` with the toy chat template of tests/serve_fakes.py (the
    saved model has no tokenizer files) and ``engine`` (None: the real one) in place of
    ``edl.serve.engine``; the app it would serve, captured."""
    import edl.cli.generate
    import edl.serve.server
    from edl.cli import main

    load = edl.cli.generate.load_model_and_tokenizer
    monkeypatch.setattr(
        edl.cli.generate,
        "load_model_and_tokenizer",
        lambda path, **kw: (load(path, **kw)[0], ChatBytes()),
    )
    if engine is not None:
        monkeypatch.setitem(sys.modules, "edl.serve.engine", types.SimpleNamespace(Engine=engine))
    served = []
    monkeypatch.setattr(edl.serve.server, "serve", lambda app, **kw: served.append(app))
    main(
        [
            "serve",
            "--model",
            str(directory),
            "--max-batch",
            "1",
            "--max-model-len",
            "48",
            "--served-model-name",
            "m",
        ]
    )
    return served[0]


def test_cli_serve_builds_the_engine_on_the_language_model(tmp_path, monkeypatch, capsys):
    from edl.io import save_pretrained

    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _shapes())
    save_pretrained(zeros, tmp_path / "g3")
    built = []

    def stand_in(model, **options):
        built.append((type(model).__name__, options["max_model_len"]))
        raise ValueError("stop here")

    with pytest.raises(SystemExit):
        _serve_main(tmp_path / "g3", monkeypatch, stand_in)
    assert built == [("Gemma3ForCausalLM", 48)]
    assert "vision-language model: serving its language model, text only" in (
        capsys.readouterr().err
    )


@pytest.mark.slow  # edl serve's engine compiled for a prefill and a decode shape (~15 s)
def test_cli_serve_answers_a_text_chat_on_gemma3_multimodal(gemma3, tmp_path, monkeypatch):
    from edl.io import save_pretrained
    from edl.serve.server import make_server

    save_pretrained(gemma3, tmp_path / "g3")
    app = _serve_main(tmp_path / "g3", monkeypatch)
    server = make_server(app, port=0, drain_s=0.5, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        text = {"role": "user", "content": "Hi"}
        status, body = _post(port, {"messages": [text], "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        prompt = ChatBytes().apply_chat_template([text], add_generation_prompt=True)
        out = generate(gemma3, np.array([prompt]), max_new_tokens=4, do_sample=False)
        want = np.asarray(out.sequences[0, len(prompt) :]).tolist()
        assert body["usage"]["completion_tokens"] == len(want)
        if 258 not in want:  # no EOS: the reply is the bytes decoded
            assert body["choices"][0]["message"]["content"] == ChatBytes().decode(want)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        status, body = _post(port, {"messages": [{"role": "user", "content": [image]}]})
        assert status == 400, body
        assert "image parts ('image_url') are not served yet" in body["error"]["message"]
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(10)


def _post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({"model": "m", **body}),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
