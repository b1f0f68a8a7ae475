"""``edl train --method grpo --environment module:factory``: wrong factories refused with one
error line naming the value, before any model loads; and (slow) a run end to end in a
subprocess with a tool the model calls, its checkpoint loaded and its tool calls logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edl.cli import main

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")

ENVIRONMENTS = '''
from edl.train.environments import ToolEnvironment

def ping() -> str:
    """Answers pong."""
    return "pong"

def says_pong(record, messages) -> float:
    return float(messages[-1]["content"].strip() == "pong")

def make():
    return ToolEnvironment([ping], reward=says_pong, timeout=5.0)

NOT_CALLABLE = 3

def wrong():
    return 42

def broken():
    raise RuntimeError("no such sandbox")
'''


def _setup(tmp_path: Path) -> list[str]:
    (tmp_path / "my_envs.py").write_text(ENVIRONMENTS)
    (tmp_path / "model").mkdir()
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "ping me"}) + "\n" for _ in range(4)))
    return ["train", "--method", "grpo", "--model", str(tmp_path / "model"), "--data", str(data)]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no_such_module:make", "cannot import 'no_such_module'"),
        ("my_envs:nope", "'my_envs' has no 'nope'"),
        ("my_envs:NOT_CALLABLE", "int is not callable"),
        ("my_envs:wrong", "it returned int 42, expected an environment with reset"),
        ("my_envs:broken", "calling it raised RuntimeError: no such sandbox"),
        ("my_envs", "expected module:function"),
    ],
)
def test_a_wrong_environment_is_one_error_line_naming_it(
    tmp_path, monkeypatch, capsys, value, message
):
    argv = _setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the run adds the working directory
    sys.modules.pop("my_envs", None)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--environment", value, "--max-turns", "2"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edl train: error: --environment ")
    assert value in err[0] and message in err[0], err[0]


def _sft_tool_model(directory: Path) -> None:
    """A tiny Llama taught (a few hundred SFT steps on one conversation) to answer the
    prompt with a ``ping`` tool call and then copy the tool's answer; saved with the
    byte-level tool tokenizer of ``benchmarks.grpo_tools``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import edl
    from benchmarks.grpo_tools import tool_tokenizer
    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.train import make_train_step
    from edl.train.multiturn import template_suffix

    tok = tool_tokenizer()
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "ping me"}], add_generation_prompt=True, tools=tools
    )
    call = tok.encode('<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    answer = [{"role": "tool", "name": "ping", "content": "pong"}]
    rest = [tok.eos_id, *template_suffix(tok, answer, tok.eos_id)]
    ids = prompt + call + rest + tok.encode("pong") + [tok.eos_id]
    own = [0] * len(prompt) + [1] * len(call) + [0] * len(rest) + [1] * 5
    labels = np.where(np.asarray(own, bool), ids, -100)
    batch = {"input_ids": jnp.asarray([ids] * 4), "labels": jnp.asarray([labels] * 4)}
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_id,
    )
    tx = optax.adam(1e-2)
    state = edl.create_state(LlamaForCausalLM.init(config, key=jax.random.key(0)), tx)
    step = make_train_step(lambda m, b: m.compute_loss(b["input_ids"], b["labels"]), tx)
    for _ in range(150):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < 0.05, float(metrics["loss"])
    edl.save_pretrained(edl.state.model(state), directory)
    tok.hf.save_pretrained(directory)
    generation = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    (directory / "generation_config.json").write_text(json.dumps(generation))


@pytest.mark.slow  # a short SFT, then a 3-step GRPO run with tools in a subprocess (~60 s)
def test_grpo_with_an_environment_from_the_command_line(tmp_path, monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    from edl.io.checkpoint import latest_checkpoint
    from edl.io.export import load_model

    monkeypatch.syspath_prepend(str(ROOT))
    argv = _setup(tmp_path)
    _sft_tool_model(tmp_path / "model")
    argv += ["--environment", "my_envs:make", "--max-turns", "2", "--steps", "3"]
    argv += ["--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "48"]
    argv += ["--temperature", "0.5", "--learning-rate", "1e-4", "--warmup-steps", "0"]
    argv += ["--trackers", "none", "--output-dir", str(tmp_path / "run")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", f"from edl.cli import main; main({argv!r})"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["end_step"] == 3
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "tool_calls" in m]
    assert len(steps) == 3, lines
    assert all(m["turns"] > 1 and m["tool_calls"] > 0 for m in steps), steps
    assert max(m["reward/environment"] for m in steps) > 0, steps  # a copied "pong"
    model = load_model(latest_checkpoint(tmp_path / "run/checkpoints"))
    logits = np.asarray(model(jnp.arange(3, 19)[None]).logits)
    assert logits.shape[:2] == (1, 16) and np.isfinite(logits).all()
