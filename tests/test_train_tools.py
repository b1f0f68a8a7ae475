"""Tool-use and multi-turn rollouts: the Hermes tool-call parser, tools run with a deadline
and error capture, the environment protocol, the loss mask over scripted two-turn rollouts
(exact token positions, the sequence equal to the chat template's rendering), rows finishing
at different turns, a real rollout and GRPO step with tools, and (slow) resume."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import edl
from edl.train import multiturn
from edl.train.environments import ToolEnvironment, run_tool
from edl.train.tool_formats import TOOL_FORMATS, ToolCall, parse_hermes

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.grpo_tools import environment, exact_answer, mul, tool_tokenizer  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


# --- the parser ------------------------------------------------------------------------------


def test_parser_reads_one_and_several_well_formed_calls():
    one = parse_hermes(
        'Let me compute. <tool_call>{"name": "mul", "arguments": {"a": 3}}</tool_call>'
    )
    assert one.content == "Let me compute."
    assert one.calls == (ToolCall("mul", {"a": 3}),) and one.errors == ()
    assert one.message()["tool_calls"] == [
        {"type": "function", "function": {"name": "mul", "arguments": {"a": 3}}}
    ]
    two = parse_hermes(
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    )
    assert two.calls == (ToolCall("a", {}), ToolCall("b", {"x": [1, 2]}))  # string args read
    plain = parse_hermes("42")
    assert plain.content == "42" and plain.calls == () and plain.errors == ()
    assert "tool_calls" not in plain.message()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "tool call 1: not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: expected {"name"'),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            "arguments must be a JSON object",
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}',
            "an opening <tool_call> without </tool_call>",
        ),
        ("<tool_call>" + "[" * 80 + "]" * 80 + "</tool_call>", "nested deeper than 64"),
    ],
)
def test_parser_reports_malformed_calls_without_raising(text, error):
    parsed = parse_hermes('<tool_call>{"name": "ok", "arguments": {}}</tool_call>' + text)
    assert parsed.calls == (ToolCall("ok", {}),)  # the well-formed call is still read
    assert len(parsed.errors) == 1 and error in parsed.errors[0]


def test_template_format_reads_the_tokenizers_parse_response():
    class Parsing:  # transformers 5's interface: response_template and parse_response
        response_template = "a schema"

        def parse_response(self, text, prefix):
            assert prefix == ""
            calls = [{"type": "function", "function": {"name": "mul", "arguments": {"a": 1}}}]
            return {"role": "assistant", "content": " ok ", "tool_calls": [*calls, {"x": 1}]}

    parsed = TOOL_FORMATS["template"].parse("anything", Parsing())
    assert TOOL_FORMATS["auto"].parse("anything", Parsing()) == parsed  # its own parser
    assert parsed.content == "ok" and parsed.calls == (ToolCall("mul", {"a": 1}),)
    assert parsed.errors == ("tool call 1: expected a name and an arguments object, got {'x': 1}",)


def test_template_format_needs_a_response_template(tok):
    with pytest.raises(ValueError, match="has no response_template"):
        TOOL_FORMATS["template"].parse("x", tok)
    text = '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
    assert TOOL_FORMATS["auto"].parse(text, tok) == parse_hermes(text)  # no parser of its own
    with pytest.raises(ValueError, match="tool_format must be one of auto, hermes, template"):
        ToolEnvironment([mul], tool_format="xml")


# --- running tools ---------------------------------------------------------------------------


def test_a_tool_that_raises_times_out_or_returns_non_strings_becomes_its_message():
    def boom(x):
        raise KeyError(x)

    def slow():
        time.sleep(5)

    class Opaque:
        def __str__(self):
            return "opaque!"

    assert run_tool(boom, {"x": "k"}, 1.0) == "error: tool 'boom' raised KeyError: 'k'"
    t0 = time.perf_counter()
    assert run_tool(slow, {}, 0.05) == "error: tool 'slow' timed out after 0.05 s"
    assert time.perf_counter() - t0 < 2  # the rollout did not wait for the tool
    assert run_tool(lambda: 42, {}, 1.0) == "42"
    assert run_tool(lambda: {"a": [1, "é"]}, {}, 1.0) == '{"a": [1, "é"]}'
    assert run_tool(lambda: Opaque(), {}, 1.0) == "opaque!"
    assert run_tool(mul, {"a": 2}, 1.0).startswith("error: tool 'mul' raised TypeError")


def test_tool_environment_steps():
    env = environment()
    assert env.tools[0]["function"]["name"] == "mul" and env.stop == "</tool_call>"
    opening = env.reset({"prompt": "3*4", "answer": "12"})
    assert opening == [{"role": "user", "content": "3*4"}]
    call = '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>'
    assert env.step({"role": "assistant", "content": call}) == (
        [{"role": "tool", "name": "mul", "content": "12"}],
        0.0,
        False,
    )
    bad = '<tool_call>{"name": "div", "arguments": {}}</tool_call><tool_call>{</tool_call>'
    answers, reward, done = env.step({"role": "assistant", "content": bad})
    assert [m["content"][:25] for m in answers] == [
        "error: unknown tool 'div'",
        "error: tool call 1: not J",
    ]
    assert (reward, done) == (0.0, False)
    assert env.step({"role": "assistant", "content": " 12 "}) == ([], 1.0, True)
    assert env.messages[-1] == {"role": "assistant", "content": "12"}
    assert exact_answer({"answer": 12}, [{"content": "13"}]) == 0.0


# --- scripted rollouts: exact token positions ------------------------------------------------


class _Scripted:
    """Stands in for ``_generate_turn``: each call returns the next scripted turn of every
    row given (rows named by their prompt), recording the batch sizes."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, []

    def __call__(self, model, rows, key, sampling, size):
        self.calls.append((len(rows), size))
        out = []
        for row in rows:
            name = row.env.record["prompt"]
            text, stop = self.turns[name].pop(0)
            out.append(self.tok.encode(text) + ([] if stop is None else [stop]))
        return out


def _tokens(tok, text):
    return tok.encode(text)


def test_a_two_turn_rollout_masks_exactly_the_models_tokens(tok, monkeypatch):
    eos, close = tok.eos_id, tok.encode("</tool_call>")[0]
    call = '<tool_call>{"name": "mul", "arguments": {"a": 347, "b": 812}}'
    script = _Scripted(tok, {"347*812": [(call, close), ("281764", eos)]})
    monkeypatch.setattr(multiturn, "_generate_turn", script)
    env = environment()
    [row] = multiturn.multi_turn_rollout(
        None,
        tok,
        [env],
        [{"prompt": "347*812", "answer": "281764"}],
        key=jax.random.key(0),
        max_turns=3,
        eos_id=eos,
        sampling={"pad_token_id": tok.pad_id},
    )
    assert (row.turns, row.reward, row.done, row.truncated) == (2, 1.0, True, False)
    # The whole sequence is the template's rendering of the conversation.
    conversation = [
        {"role": "user", "content": "347*812"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "mul", "arguments": {"a": 347, "b": 812}}}
            ],
        },
        {"role": "tool", "name": "mul", "content": "281764"},
        {"role": "assistant", "content": "281764"},
    ]
    rendered = tok.apply_chat_template(conversation, tools=env.tools)
    assert row.prompt + row.tokens == rendered
    prompt = tok.apply_chat_template(conversation[:1], tools=env.tools, add_generation_prompt=True)
    assert row.prompt == prompt
    first = len(tok.encode(call)) + 1  # the call and its closing tag, as sampled
    middle = tok.apply_chat_template(conversation[:3], add_generation_prompt=True, tools=env.tools)
    env_len = len(middle) - len(prompt) - first  # <|im_end|>, the tool turn, the header
    assert row.tokens[first] == eos and env_len == len(
        tok.encode(
            "<|im_end|><|im_start|>user\n<tool_response>281764</tool_response><|im_end|>"
            "<|im_start|>assistant\n"
        )
    )
    last = len(tok.encode("281764")) + 1
    assert row.own == [True] * first + [False] * env_len + [True] * last

    batch = multiturn.trajectory_batch([row], tok.pad_id)
    width_p, width_c = 48, 96  # prompt_bucket(44), prompt_bucket(86)
    assert len(prompt) == 44 and len(row.tokens) == 86
    ids, mask = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
    own = np.asarray(batch["completion_mask"])
    assert ids.shape == (1, width_p + width_c) and own.shape == (1, width_c)
    assert ids[0, 4:width_p].tolist() == prompt and not mask[0, :4].any()
    assert ids[0, width_p : width_p + 86].tolist() == row.tokens
    assert mask[0, 4 : width_p + 86].all() and not mask[0, width_p + 86 :].any()
    expected = np.zeros(width_c, np.float32)
    expected[:first] = 1
    expected[first + env_len : first + env_len + last] = 1
    np.testing.assert_array_equal(own[0], expected)


def test_rows_finish_at_different_turns(tok, monkeypatch):
    eos, close = tok.eos_id, tok.encode("</tool_call>")[0]
    call = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}'
    script = _Scripted(
        tok,
        {
            "direct": [("6", eos)],  # answers at once: done after turn 1
            "tool": [(call, close), ("6", eos)],  # calls, then answers: turn 2
            "cut": [("66666", None)],  # no stop token in the budget: truncated
            "loop": [(call, close), (call, close), (call, close)],  # cut by max_turns
        },
    )
    monkeypatch.setattr(multiturn, "_generate_turn", script)
    names = ["direct", "tool", "cut", "loop"]
    rows = multiturn.multi_turn_rollout(
        None,
        tok,
        [environment() for _ in names],
        [{"prompt": n, "answer": "6"} for n in names],
        key=jax.random.key(0),
        max_turns=2,
        eos_id=eos,
        sampling={"pad_token_id": tok.pad_id},
    )
    assert script.calls == [(4, 4), (2, 2)]  # the second turn: only the two rows still going
    assert [r.turns for r in rows] == [1, 2, 1, 2]
    assert [r.reward for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert [r.truncated for r in rows] == [False, False, True, False]
    # No environment tokens after a row's last turn: its tokens end with its own.
    assert all(r.own[-1] for r in rows)
    # The last turn was still stepped (its reward counts), its answer kept as a message only.
    assert rows[3].messages[-1]["role"] == "tool" and rows[3].own.count(False) > 0
    assert sum(rows[0].own) == len(rows[0].tokens) == 2


# --- a real model: GRPO with tools -----------------------------------------------------------


def _model(tok, seed=0):
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(seed))


_RECORDS = [{"prompt": "12*34", "answer": "408"}, {"prompt": "56*78", "answer": "4368"}]


def _tool_step(tok, tx, **overrides):
    from edl.train import GRPOConfig, make_grpo_step

    config = GRPOConfig(
        num_generations=2, max_new_tokens=6, max_turns=2, temperature=1.0, **overrides
    )
    return make_grpo_step(tx, tok, [], config, key=jax.random.key(1), environment=environment)


@pytest.mark.slow  # compiles generate and the update for a tiny model (~22 s)
def test_grpo_step_with_an_environment(tok):
    tx = optax.adam(1e-3)
    step = _tool_step(tok, tx)
    model = _model(tok)
    batch, metrics = step.rollout(model, _RECORDS, jax.random.key(2))
    assert batch["input_ids"].shape[0] == 4 and metrics["turns"] >= 1
    assert {"reward/environment", "truncated", "completion_length"} <= set(metrics)
    conversations = step.last_rollout["conversations"]
    assert [c[0]["content"] for c in conversations] == ["12*34", "12*34", "56*78", "56*78"]
    own = np.asarray(batch["completion_mask"])
    assert own.sum() == pytest.approx(metrics["completion_length"] * 4)
    state = edl.create_state(model, tx)
    state, metrics = step(state, _RECORDS)
    assert int(state.step) == 1 and np.isfinite(metrics["loss"]) and metrics["nonfinite"] == 0


def test_an_environment_needs_a_chat_template():
    from edl.train import ByteTokenizer, GRPOConfig, make_grpo_step

    with pytest.raises(ValueError, match="renders conversations with the chat template"):
        make_grpo_step(
            optax.sgd(0.1),
            ByteTokenizer(),
            [],
            GRPOConfig(),
            key=jax.random.key(0),
            environment=environment,
        )
    with pytest.raises(TypeError, match="reward_fns must be callables"):
        make_grpo_step(optax.sgd(0.1), ByteTokenizer(), [], GRPOConfig(), key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        GRPOConfig(max_turns=0)
    with pytest.raises(ValueError, match="dynamic_sampling is not supported with environment"):
        make_grpo_step(
            optax.sgd(0.1),
            tool_tokenizer(),
            [],
            GRPOConfig(dynamic_sampling=True),
            key=jax.random.key(0),
            environment=environment,
            prompt_source=iter([]),
        )


@pytest.mark.slow  # GRPO with tools through train(): 3 steps, then 2 + a resumed 1 (~40 s)
def test_grpo_with_tools_resumes_bit_exactly(tok, tmp_path):
    from edl.train import CheckpointConfig, LogConfig, PromptBatches, RunConfig, train

    tx = optax.adam(1e-2)
    step = _tool_step(tok, tx, num_iterations=2)

    def run(steps, out):
        state = edl.create_state(_model(tok), tx)
        prompts = PromptBatches(_RECORDS * 2, batch_size=2, seed=0)
        run_config = RunConfig(
            steps=steps,
            output_dir=out,
            checkpoint=CheckpointConfig(every=1),
            log=LogConfig(progress=False),
        )
        return train(state, step, prompts, run_config)

    state_a, _ = run(3, tmp_path / "a")
    run(2, tmp_path / "b")
    state_b, summary = run(3, tmp_path / "b")
    assert summary["resumed_from"] is not None and int(state_b.step) == 3
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- on-policy distillation with tools -------------------------------------------------------


def test_distillation_rollouts_label_only_the_students_tokens(tok, monkeypatch):
    from edl.train.distill_tools import tool_batch

    eos, close = tok.eos_id, tok.encode("</tool_call>")[0]
    call = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}'
    script = _Scripted(tok, {"2*3": [(call, close), ("6", eos)], "4*5": [("20", eos)]})
    monkeypatch.setattr(multiturn, "_generate_turn", script)
    options = {
        "environment": environment,
        "tokenizer": tok,
        "max_turns": 2,
        "max_new_tokens": 64,
        "temperature": 1.0,
        "eos_token_id": eos,
        "pad_token_id": tok.pad_id,
    }
    records = [{"prompt": "2*3", "answer": "6"}, {"prompt": "4*5", "answer": "20"}]
    batch = tool_batch(options, None, records, jax.random.key(0))
    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
    counted = labels != -100
    np.testing.assert_array_equal(labels[counted], ids[counted])  # unshifted: the ids
    # Row 0: the call (with its closing tag) and the answer; row 1: the answer alone.
    own_0 = [*tok.encode(call), close, *tok.encode("6"), eos]
    assert ids[0][counted[0]].tolist() == own_0
    assert ids[1][counted[1]].tolist() == [*tok.encode("20"), eos]
    tool_turn = tok.encode("<tool_response>6</tool_response>")
    text = ids[0][np.asarray(batch["attention_mask"][0]) > 0].tolist()
    assert any(text[i : i + len(tool_turn)] == tool_turn for i in range(len(text)))
    with pytest.raises(ValueError, match="must be a non-empty list of prompt records"):
        tool_batch(options, None, {"prompt_ids": 1}, jax.random.key(0))


def test_distillation_with_an_environment_must_sample_every_step(tok):
    import equinox as eqx

    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.train import make_distill_step

    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=8, num_attention_heads=1)
    # Shapes only (no arrays to build): the options are refused before the teacher is used.
    teacher = eqx.filter_eval_shape(LlamaForCausalLM.init, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="every step must sample: lmbda=1 or seq_kd"):
        make_distill_step(
            optax.sgd(0.1),
            teacher,
            lmbda=0.5,
            key=jax.random.key(0),
            eos_token_id=tok.eos_id,
            environment=environment,
            tokenizer=tok,
        )
    with pytest.raises(ValueError, match="pass the model's tokenizer="):
        make_distill_step(
            optax.sgd(0.1),
            teacher,
            lmbda=1.0,
            key=jax.random.key(0),
            eos_token_id=tok.eos_id,
            environment=environment,
        )


@pytest.mark.slow  # compiles generate and the distillation update for two tiny models (~30 s)
def test_on_policy_distillation_with_tools_runs_a_step(tok):
    from edl.train import make_distill_step

    tx = optax.adam(1e-3)
    student, teacher = _model(tok, seed=0), _model(tok, seed=1)
    step = make_distill_step(
        tx,
        teacher,
        lmbda=1.0,
        max_new_tokens=6,
        key=jax.random.key(0),
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        environment=environment,
        tokenizer=tok,
        max_turns=2,
    )
    state = edl.create_state(student, tx)
    state, metrics = step(state, _RECORDS)
    assert metrics["on_policy"] == 1.0 and np.isfinite(metrics["loss"])
    assert metrics["count"] == pytest.approx(metrics["completion_length"] * 2)
