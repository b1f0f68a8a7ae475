"""``edl train --method dpo|reward|grpo`` on a small model built like the README fine-tune
test's (a 2-layer Llama with a BPE tokenizer and a ChatML template): each method runs, its
metrics move the right way, and its checkpoints are what transformers loads. Option errors
answer before any work (no jax)."""

from __future__ import annotations

import json

import pytest

from edl.cli.config import ConfigError, TrainConfig
from tests.test_finetune_readme import CONVERSATIONS, _build_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "dpo"}, "--method dpo needs --model"),
        ({"method": "dpo", "model": "m", "data": "d", "format": "chat"}, "--format is for"),
        ({"method": "grpo", "model": "m", "data": "d"}, "--method grpo needs --reward"),
        ({"method": "dpo", "model": "m", "data": "d", "environment": "e:f"}, "--environment is"),
        (
            {"method": "grpo", "model": "m", "data": "d", "reward": "r:f", "max_turns": 2},
            "--max-turns is for --method grpo with --environment",
        ),
        ({"method": "dpo", "model": "m", "data": "d", "reward": "r:f"}, "--reward is for"),
        (
            {"method": "dpo", "model": "m", "data": "d", "reference": "lora"},
            "--reference lora needs --lora-rank",
        ),
        (
            {"method": "grpo", "model": "m", "data": "d", "reward": "r:f", "eval_data": "e"},
            "--eval-data is for --method sft, dpo, reward and kto, not grpo",
        ),
        (
            {"method": "grpo", "model": "m", "data": "d", "reward": "r:f", "temperature": 0.0},
            "--temperature must be > 0",
        ),
        ({"method": "ppo"}, "method must be one of sft, dpo, reward, grpo"),
        (
            {"method": "dpo", "model": "m", "data": "d", "loss_type": "dapo"},
            "--loss-type for --method dpo must be one of sigmoid, ipo",
        ),
        (
            {"method": "grpo", "model": "m", "data": "d", "reward": "r:f", "loss_type": "ipo"},
            "--loss-type for --method grpo must be one of grpo, bnpo, dr_grpo, dapo, cispo",
        ),
        (
            {"method": "grpo", "model": "m", "data": "d", "reward": "r:f"}
            | {"top_entropy_quantile": 1.5},
            "top_entropy_quantile must be <= 1",
        ),
    ],
)
def test_post_training_options_are_checked_before_any_work(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options)
    assert TrainConfig(model="m", data="d", method="dpo", lora_rank=4).reference_kind == "lora"
    assert TrainConfig(model="m", data="d", method="dpo").reference_kind == "model"


def test_an_empty_loss_type_is_the_methods_default():
    """run.md records the loss a run used: DPO's sigmoid, GRPO's dapo (TRL 1.16's)."""
    grpo = TrainConfig(model="m", data="d", method="grpo", reward="r:f")
    assert grpo.loss_type == "" and grpo.method_loss_type == "dapo"
    assert grpo.in_effect()["loss_type"] == "dapo"
    assert TrainConfig(model="m", data="d", method="dpo").in_effect()["loss_type"] == "sigmoid"
    options = {"method": "grpo", "model": "m", "data": "d", "reward": "r:f", "loss_type": "sapo"}
    assert TrainConfig.from_options(options).in_effect()["loss_type"] == "sapo"


def _preferences(path, records=12) -> None:
    with path.open("w") as f:
        for i in range(records):
            ((user, good),) = CONVERSATIONS[i % len(CONVERSATIONS)]
            bad = CONVERSATIONS[(i + 1) % len(CONVERSATIONS)][0][1]
            record = {
                "prompt": [{"role": "user", "content": user}],
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
            f.write(json.dumps(record) + "\n")


REWARDS = """
def says_paris(prompts, completions, completion_ids, answer):
    return [float(a in c) + 0.01 * len(c) for c, a in zip(completions, answer)]
"""


@pytest.mark.slow  # three CLI runs that each compile a train step (~2 minutes)
def test_dpo_reward_and_grpo_from_the_command_line(tmp_path, capsys, monkeypatch):
    import jax.numpy as jnp
    import numpy as np
    import torch

    from edl.cli import main
    from edl.io.checkpoint import latest_checkpoint
    from edl.io.export import load_model

    _build_model(tmp_path / "model")
    _preferences(tmp_path / "prefs.jsonl")
    common = [
        "train",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(tmp_path / "prefs.jsonl"),
        "--batch-size",
        "4",
        "--seq-len",
        "48",
        "--warmup-steps",
        "0",
        "--learning-rate",
        "5e-3",
        "--lora-rank",
        "8",
    ]

    # DPO against the LoRA-off base: the margin and accuracy rise from 0 / 0, on the
    # training pairs and on held-out ones (10 of them: the last batch of 4 is cut to its 2
    # real pairs, so every mean is over the 10).
    _preferences(tmp_path / "held_out.jsonl", records=10)
    held_out = ["--eval-data", str(tmp_path / "held_out.jsonl"), "--eval-every", "6"]
    dpo_dir = tmp_path / "dpo"
    main([*common, *held_out, "--method", "dpo", "--steps", "12", "--output-dir", str(dpo_dir)])
    dpo = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert dpo["end_step"] == 12 and dpo["final_loss"] < dpo["first_loss"]
    assert abs(dpo["first_rewards/margins"]) < 1e-5 and dpo["final_rewards/margins"] > 0.1
    assert dpo["final_rewards/accuracies"] == 1.0
    assert dpo["final_eval_rewards/margins"] > dpo["first_eval_rewards/margins"] > 0
    evals = [m for m in map(json.loads, (dpo_dir / "metrics.jsonl").open()) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [6, 12] and {m["eval_count"] for m in evals} == {10}
    checkpoint = latest_checkpoint(tmp_path / "dpo/checkpoints")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = np.arange(3, 19)[None]
    with torch.no_grad():
        np.testing.assert_allclose(
            hf(torch.tensor(ids)).logits.numpy(),
            np.asarray(load_model(checkpoint)(jnp.asarray(ids)).logits),
            atol=1e-4,
        )

    # A reward model (new score head + LoRA): chosen ranked above rejected; transformers
    # loads the checkpoint as LlamaForSequenceClassification with the same scores.
    main([*common, "--method", "reward", "--steps", "12", "--output-dir", str(tmp_path / "reward")])
    reward = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert reward["final_loss"] < reward["first_loss"] and reward["final_accuracy"] == 1.0
    checkpoint = latest_checkpoint(tmp_path / "reward/checkpoints")
    scorer = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        want = scorer(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(load_model(checkpoint)(jnp.asarray(ids)).logits), want, atol=1e-4
    )

    # GRPO with a reward module from the working directory and a record column.
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": u}], "answer": "Paris"}) + "\n"
            for c in CONVERSATIONS
            for u, _ in c
        )
    )
    monkeypatch.chdir(tmp_path)
    main(
        [
            "train",
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(prompts),
            "--method",
            "grpo",
            "--reward",
            "my_rewards:says_paris",
            "--lora-rank",
            "8",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--num-generations",
            "4",
            "--max-new-tokens",
            "8",
            "--beta",
            "0.05",
            "--loss-type",
            "cispo",
            "--importance-sampling-level",
            "sequence",
            "--mask-truncated-completions",
            "--top-entropy-quantile",
            "0.5",
            "--dynamic-sampling",
            "--grad-accum-steps",
            "2",
            "--output-dir",
            str(tmp_path / "grpo"),
        ]
    )
    grpo = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert grpo["end_step"] == 2 and "final_reward_mean" in grpo and grpo["final_kl"] >= 0
    metrics = [
        json.loads(line) for line in (tmp_path / "grpo/metrics.jsonl").read_text().splitlines()
    ]
    assert any("reward/says_paris" in m for m in metrics)
    assert all("dynamic_sampling/rounds" in m for m in metrics if "reward_mean" in m)


def test_grpo_prompts_are_checked_like_chat_records(tmp_path):
    """GRPO prompts go through the same role and text checks as chat records: from a file
    with its ``file:line``, in memory with the prompt's index; ``developer`` is given to
    the template as ``system``."""
    from edl.cli.post import CommandError, _prompt_batches
    from edl.train.grpo import PromptBatches

    data = tmp_path / "prompts.jsonl"
    system = {"role": "developer", "content": "Be brief."}
    good = {"prompt": [system, {"role": "user", "content": "Capital of France?"}]}
    bad = {"prompt": [{"role": "hacker", "content": "hi"}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    config = TrainConfig(model="m", data=str(data), method="grpo", reward="r:f")
    roles = r"prompt\[0\]\.role must be one of \['system', 'developer'.*got 'hacker'"
    with pytest.raises(CommandError, match=r"prompts\.jsonl:2: " + roles):
        _prompt_batches(config)
    data.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "caf\ud800"}) + "\n")
    with pytest.raises(CommandError, match=r"prompts\.jsonl:2: field 'prompt'.*surrogate"):
        _prompt_batches(config)
    data.write_text(json.dumps(good) + "\n")
    (record,) = _prompt_batches(config).documents
    assert record["prompt"][0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt\[0\]\.role .*'hacker'"):
        PromptBatches([good, bad], batch_size=1)


def test_preference_batches_are_checked_on_the_host_naming_the_array():
    """Post-training steps compile without the in-program id check (a host callback, which
    jax never writes to its persistent cache): the batches are checked as they are drawn."""
    import numpy as np

    from edl.cli.run import HostCheckedBatches

    good = np.array([[1, 2, 3]])
    batch = {
        "chosen_input_ids": good,
        "chosen_labels": np.array([[-100, 2, 3]]),
        "rejected_input_ids": good,
        "rejected_labels": np.array([[-100, 2, 99]]),
    }
    with pytest.raises(ValueError, match=r"rejected_labels.*99"):
        next(HostCheckedBatches(iter([batch]), 16))
    batch["rejected_labels"] = np.array([[-100, 2, 3]])
    assert next(HostCheckedBatches(iter([batch]), 16)) is batch


@pytest.mark.slow  # two one-step runs of each method in subprocesses (~40 s each)
@pytest.mark.parametrize("method", ["dpo", "reward"])
def test_a_restarted_post_training_run_loads_its_step_from_the_compilation_cache(tmp_path, method):
    import os
    import subprocess
    import sys

    _build_model(tmp_path / "model")
    data = tmp_path / "prefs.jsonl"
    _preferences(data)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "EDL_COMPILE_CACHE": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [
        *("train", "--method", method, "--model", str(tmp_path / "model")),
        *("--data", str(data), "--lora-rank", "4", "--steps", "1"),
        *("--batch-size", "2", "--seq-len", "64", "--trackers", "none", "--overwrite"),
        *("--output-dir", str(tmp_path / "run")),
    ]
    code = f"from edl.cli import main; main({argv!r})"
    said = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        said.append([x for x in done.stderr.replace("\r", "\n").splitlines() if " ready in " in x])
    first = [x for x in said[0] if "the train step" in x]
    second = [x for x in said[1] if "the train step" in x]
    assert len(first) == len(second) == 1, said
    assert first[0].endswith("(compiled)")
    assert second[0].endswith("(from the compilation cache)"), said[1]


def test_environment_factories_are_imported_like_reward_functions():
    from edl.cli import CommandError
    from edl.cli.post import environment_factory

    grpo = {"method": "grpo", "model": "m", "data": "d"}
    assert environment_factory(TrainConfig(**grpo, reward="r:f")) is None
    config = TrainConfig(**grpo, environment="benchmarks.grpo_tools:environment", max_turns=3)
    assert environment_factory(config)().stop == "</tool_call>"
    with pytest.raises(CommandError, match=r"--environment benchmarks\.grpo_tools:nope: "):
        environment_factory(TrainConfig(**grpo, environment="benchmarks.grpo_tools:nope"))
    with pytest.raises(CommandError, match="expected one module:function"):
        environment_factory(TrainConfig(**grpo, environment="a:b,c:d"))
