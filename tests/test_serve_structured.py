"""Structured output and tool calls (edl.serve.grammar, edl.serve.structured): the logits
mask, the request fields' checks (400s naming the field), tool calls parsed out of a reply
(plain and streamed, through the official ``openai`` client against a fake engine), and, on
a tiny random Llama with a small Hugging Face tokenizer built here (a Hermes-style chat
template with tools), JSON schemas respected by sampled replies, plain requests unchanged
beside constrained ones, and forced tool calls end to end.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
llguidance = pytest.importorskip("llguidance")

from serve_fakes import EOS, MODEL, ChatBytes, FakeEngine  # noqa: E402

from edl.serve import protocol  # noqa: E402
from edl.serve.grammar import json_schema_grammar, mask_logits  # noqa: E402
from edl.serve.server import create_app, make_server  # noqa: E402
from edl.serve.structured import ToolText, parse_tool_calls  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
REPLY = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln", '
    '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def valid(value, schema=SCHEMA) -> bool:
    """``value`` matches ``SCHEMA``'s kind of schema: an object of required string /
    integer / enum properties with bounds, and nothing else."""
    props = schema["properties"]
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    for key, rule in props.items():
        v = value[key]
        if "enum" in rule:
            ok = v in rule["enum"]
        elif rule["type"] == "string":
            ok = isinstance(v, str) and len(v) <= rule.get("maxLength", len(v))
        else:
            ok = type(v) is int and rule["minimum"] <= v <= rule["maximum"]
        if not ok:
            return False
    return True


def test_mask_logits_follows_llguidance_bit_layout():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # a row without a grammar: all allowed, unchanged
    want = logits.copy()
    apply_token_bitmask_inplace(want, bitmask)
    got = np.asarray(mask_logits(logits, bitmask))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], logits[1])


def _chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


BAD = [
    (_chat(response_format={"type": "xml"}), "response_format"),
    (_chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
        "response_format.json_schema.name",
    ),
    (
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            }
        ),
        "response_format.json_schema.schema",
    ),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]),
        "tools[0].function.parameters",
    ),
    (_chat(tools=[TIME, TIME]), "tools"),
    (_chat(tool_choice="required"), "tool_choice"),
    (_chat(tools=[TIME], tool_choice="always"), "tool_choice"),
    (
        _chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    (
        _chat(tools=[TIME], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_structured_requests_are_400_naming_the_field(body, param):
    with pytest.raises(protocol.APIError) as caught:
        protocol.parse_chat(body)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


def test_completions_take_response_format_not_tools():
    req = protocol.parse_completion(
        {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}
    )
    assert req.sampling_params(4, ()).grammar == req.grammar and req.grammar
    with pytest.raises(protocol.APIError, match="unknown field 'tools'"):
        protocol.parse_completion({"model": MODEL, "prompt": "x", "tools": [TIME]})
    plain = protocol.parse_completion({"model": MODEL, "prompt": "x"})
    assert plain.sampling_params(4, ()).grammar is None


def test_parse_tool_calls():
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me look. "
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Köln", "unit": "C"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls") == ("no calls", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls(REPLY[REPLY.index("<") :])[0] is None  # no text before: None


@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_tool_text_holds_back_calls_split_anywhere(size):
    text = ToolText()
    sent = "".join(text.push(REPLY[i : i + size]) for i in range(0, len(REPLY), size))
    rest, calls = text.end()
    assert sent + rest == "Let me look. " and len(calls) == 2
    plain = ToolText()  # a "<" that starts no call is sent in the end
    sent = "".join(plain.push(c) for c in "a < b <tool")
    assert sent + plain.end()[0] == "a < b <tool" and plain.end()[1] == []


class ToolChat(ChatBytes):
    """The byte tokenizer's chat template, with tools written first when given."""

    def apply_chat_template(self, messages, *, add_generation_prompt=False, tools=None):
        head = self.encode("" if tools is None else f"<tools>{json.dumps(tools)}\n")
        return head + super().apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )


@contextlib.contextmanager
def serving(engine, tokenizer, max_model_len: int = 1024):
    """The app over ``engine`` on a free loopback port; yields its base URL."""
    app = create_app(
        engine, tokenizer, model_name=MODEL, max_model_len=max_model_len, stop_token_ids=[EOS]
    )
    server = make_server(app, port=0, drain_s=1.0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(10)


def test_tool_calls_in_every_choice_of_n():
    """``n`` > 1: each choice parses its own tool calls, plain and streamed (each delta
    under its choice's index)."""
    engine = FakeEngine(reply=lambda ids, seed=None: REPLY)
    with serving(engine, ToolChat()) as url:
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Köln?"}]
        out = api.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, TIME], n=2, seed=1
        )
        assert [c.index for c in out.choices] == [0, 1]
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            assert [c.function.name for c in choice.message.tool_calls] == [
                "get_weather",
                "get_time",
            ]
        chunks = list(
            api.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER, TIME], n=2, seed=1, stream=True
            )
        )
        calls = {0: [], 1: []}
        finish = {}
        for chunk in chunks:
            choice = chunk.choices[0]
            calls[choice.index] += [d.function.name for d in choice.delta.tool_calls or []]
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        assert calls == {i: ["get_weather", "get_time"] for i in (0, 1)}
        assert finish == {0: "tool_calls", 1: "tool_calls"}


def test_tool_calls_plain_and_streamed_through_the_openai_client():
    engine = FakeEngine(reply=lambda ids, seed=None: REPLY)
    with serving(engine, ToolChat()) as url:
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Köln?"}]
        out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look. "
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name) for c in calls] == [
            ("function", "get_weather"),
            ("function", "get_time"),
        ]
        assert json.loads(calls[0].function.arguments) == {"city": "Köln", "unit": "C"}
        assert engine.params[-1].grammar is None  # "auto": not constrained
        stream = api.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, TIME], stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert text == "Let me look. " and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather"), (1, "get_time")]
        assert json.loads(deltas[0].function.arguments) == {"city": "Köln", "unit": "C"}
        # Forced: a grammar goes to the engine; "none": no tools rendered, the text as it is.
        api.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required"
        )
        assert "get_weather" in engine.params[-1].grammar
        out = api.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none"
        )
        assert out.choices[0].message.content == REPLY and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop" and engine.params[-1].grammar is None
        # response_format on both endpoints: a grammar in the request's params.
        api.completions.create(  # vLLM's extension: the openai client takes it as extra_body
            model=MODEL, prompt="x", extra_body={"response_format": {"type": "json_object"}}
        )
        assert engine.params[-1].grammar
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(
                model=MODEL,
                messages=messages,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                },
            )
        assert caught.value.body["param"] == "response_format.json_schema.schema"


HERMES = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools>\nCall a function as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    """``(model, tokenizer)``: a random 2-layer Llama and a 300-token byte-level BPE
    tokenizer with a Hermes-style chat template (``<tool_call>`` calls), EOS ``<|im_end|>``."""
    import jax
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.text import HFTokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [REPLY, json.dumps(SCHEMA), '{"name": "Ada", "age": 36, "color": "red"}']
    raw.train_from_iterator(texts * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>"
    )
    fast.chat_template = HERMES
    config = LlamaConfig(
        vocab_size=320,  # padded beyond the tokenizer's 300: those ids are never allowed
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(0)), HFTokenizer(fast, "tiny")


def _engine(tiny, *, grammar: bool = True, max_batch: int = 4, max_model_len: int = 128):
    from edl.serve.engine import Engine

    model, tok = tiny
    return Engine(
        model,
        max_batch=max_batch,
        max_model_len=max_model_len,
        page_size=16,
        prefill_chunk=16,
        eos_token_ids=(tok.eos_id,),
        tokenizer=tok if grammar else None,
    )


def _run(engine, requests) -> list[tuple[list[int], str]]:
    """Each ``(prompt, params)``'s tokens and finish reason."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    tokens, reasons = {i: [] for i in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(tokens[i], reasons[i]) for i in ids]


def test_engine_without_a_tokenizer_refuses_grammars(tiny):
    from edl.serve.types import SamplingParams

    engine = _engine(tiny, grammar=False)
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    with pytest.raises(ValueError, match="grammar needs an Engine built with a tokenizer"):
        engine.add_request([5, 6], params)


def test_plain_steps_run_the_unmasked_program(tiny, monkeypatch):
    """Rows with a grammar get their bitmask (all ones for the others, for rows whose
    sampled token is dropped); a call with no such row runs the plain sampler
    (``allowed=None``). The model step is a stand-in here whose logits favour "{"."""
    import jax.numpy as jnp

    import edl.serve.engine as engine_module
    import edl.serve.sampler as sampler_module
    from edl.serve.grammar import any_json_grammar
    from edl.serve.types import SamplingParams

    _, tok = tiny
    start, calls = tok.hf.convert_tokens_to_ids("{"), []
    engine = _engine(tiny)

    def step(model, k, v, table, lengths, tokens, num_new, targets=None, *, logprobs):
        logits = np.full((tokens.shape[0], engine.vocab_size), -1.0, np.float32)
        logits[:, start] = 0.0  # every row says "{"
        return k, v, jnp.asarray(logits), None

    real = sampler_module.sample_step

    def spy(logits, sampling, allowed=None):
        calls.append(None if allowed is None else np.asarray(allowed))
        return real(logits, sampling, allowed)

    monkeypatch.setattr(engine_module, "model_step", step)
    monkeypatch.setattr(sampler_module, "sample_step", spy)
    engine.add_request(tok.encode("Hello"), SamplingParams(max_tokens=2))
    engine.step()  # prefill: its token is sampled
    assert calls == [None]
    grammar = engine.add_request(tok.encode("Hi"), SamplingParams(grammar=any_json_grammar()))
    engine.step()  # the plain request decodes, the constrained one prefills
    assert calls[1] is None and calls[2].shape == (1, 10)
    allowed = np.unpackbits(calls[2][0].view(np.uint8), bitorder="little")
    assert allowed[start] and allowed.sum() < 300 and not allowed[300:].any()
    assert grammar in engine._live


@pytest.mark.slow  # two engines, plain and masked programs (~11 s idle, ~40 s on a busy VM)
def test_json_object_parses_and_plain_requests_are_unchanged(tiny):
    """Beside a json_object request, plain ones (greedy and sampled) give the tokens an
    engine with no grammar support gives them; the constrained reply is a JSON object."""
    from edl.serve.grammar import any_json_grammar
    from edl.serve.types import SamplingParams

    _, tok = tiny
    prompt = tok.encode("Hello")
    plain = [
        (prompt, SamplingParams(max_tokens=12, temperature=0.0)),
        (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3)),
    ]
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=1, grammar=any_json_grammar())
    before = _run(_engine(tiny, grammar=False), plain)
    *after, (tokens, reason) = _run(_engine(tiny), [*plain, (prompt, constrained)])
    assert after == before
    assert reason == "stop" and isinstance(json.loads(tok.decode(tokens)), dict)


@pytest.mark.slow  # 50 sampled replies, plain and masked programs (~9 s idle, ~40 s busy)
def test_json_schema_is_respected_on_50_sampled_replies(tiny):
    from edl.serve.types import SamplingParams

    _, tok = tiny
    grammar = json_schema_grammar(SCHEMA)
    requests = [
        (tok.encode(f"Person {i}:"), SamplingParams(max_tokens=64, seed=i, grammar=grammar))
        for i in range(50)
    ]
    replies = _run(_engine(tiny, max_batch=16), requests)
    texts = [tok.decode(tokens) for tokens, _ in replies]
    assert {reason for _, reason in replies} == {"stop"}
    assert all(valid(json.loads(t)) for t in texts), texts
    assert len(set(texts)) > 40  # sampled, not one reply


@pytest.mark.slow  # the real engine behind the app, openai client (~6 s idle, ~50 s busy)
def test_forced_tool_calls_and_json_schema_end_to_end(tiny):
    """tool_choice "required" / named and a json_schema response_format on the real engine:
    the template renders the tools, the grammar makes the random model's reply a valid
    call, and the reply comes back parsed (plain and streamed)."""
    _, tok = tiny
    engine = _engine(tiny, max_model_len=512)  # the tools take ~300 tokens of this BPE
    with serving(engine, tok, max_model_len=512) as url:
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Weather?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            # One call: a random model would go on calling until max_tokens with several.
            one = {"tool_choice": choice, "parallel_tool_calls": False, "seed": 0}
            out = api.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER], **one
            )
            assert out.choices[0].finish_reason == "tool_calls", out
            (call,) = out.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            assert valid(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            chunks = list(
                api.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    tools=[WEATHER],
                    stream=True,
                    **one,
                )
            )
            (delta,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            assert delta.function.arguments == call.function.arguments  # same seed, same call
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        schema = {"name": "person", "schema": SCHEMA, "strict": True}
        out = api.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={"type": "json_schema", "json_schema": schema},
            seed=1,
        )
        assert out.choices[0].finish_reason == "stop"
        assert valid(json.loads(out.choices[0].message.content))
        _wait_free(engine)


def _wait_free(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.num_free_pages != engine.num_total_pages:  # no page leaks
        assert time.monotonic() < deadline
        time.sleep(0.05)


# A Qwen2.5 / Hermes-shaped chat template (tools in the system turn, calls in <tool_call>
# blocks with arguments as JSON, results in <tool_response> blocks), written for this test.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{%- for call in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ call.function.name }}'
    '", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}'
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer with ``TOOL_TEMPLATE``, saved as transformers does,
    and loaded by edl; returns (edl's tokenizer, transformers')."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edl.text import load_tokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(['<tool_call>{"name": "get_weather"}</tool_call> Köln'] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TOOL_TEMPLATE
    directory = tmp_path_factory.mktemp("tool_tokenizer")
    fast.save_pretrained(directory)
    return load_tokenizer(directory), fast


def test_a_tool_loop_reaches_the_template_as_transformers_renders_it(tool_tokenizer):
    """OpenAI's tool loop (an assistant's ``tool_calls``, content null, arguments a JSON
    string; a ``tool`` result with its ``tool_call_id``) through the openai client gives
    the engine exactly the prompt transformers renders from the same conversation (the
    arguments as a dict, as HF's templates take them)."""
    tokenizer, fast = tool_tokenizer
    engine = FakeEngine()
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Köln", "unit": "C"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    with serving(engine, tokenizer) as url:
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        out = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert out.choices[0].finish_reason == "stop"
    hf_call = {
        **call,
        "function": {"name": "get_weather", "arguments": {"city": "Köln", "unit": "C"}},
    }
    hf_messages = [
        messages[0],
        {"role": "assistant", "content": "", "tool_calls": [hf_call]},
        messages[2],
    ]
    want = fast.apply_chat_template(
        hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    sent = engine.prompts[max(engine.prompts)]
    assert sent == list(want)
    text = fast.decode(sent)
    assert '{"name": "get_weather", "arguments": {"city": "Köln", "unit": "C"}}' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "18 C"}, "messages[1].tool_call_id"),
        ({"role": "tool", "content": "18 C", "tool_call_id": 3}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages[1]"),
        ({"role": "assistant", "tool_calls": []}, "messages[1].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]},
            "messages[1].tool_calls[0].function",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "\ud800", "arguments": "{}"}}],
            },
            "messages[1].tool_calls",
        ),
        ({"role": "function", "content": "x"}, "messages[1].role"),
    ],
)
def test_bad_tool_loop_messages_are_400s_naming_the_field(message, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, message]}
    with pytest.raises(protocol.APIError) as caught:
        protocol.parse_chat(body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value
