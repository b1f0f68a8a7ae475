"""The post-training tutorial's commands (docs/tutorials/post-training.md,
"post-training-commands"), run as written on a small model, with the data files the tutorial
shows (its ``<!-- file: NAME -->`` blocks).

The model is the fine-tune tutorial test's (``test_finetune_readme._build_model``: a 2-layer
Llama with a BPE tokenizer and a ChatML template); only the block's ``MODEL=`` line is
changed. Each command must finish, print its JSON summary with ``end_step`` equal to its
``--steps``, and leave a final checkpoint that loads.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.test_finetune_readme import _build_model, _commands, _run

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorials" / "post-training.md"


def commands() -> str:
    """The tutorial's command block."""
    block = re.search(
        r"<!-- post-training-commands -->\n```bash\n(.*?)\n```\n<!-- /post-training-commands -->",
        TUTORIAL.read_text(),
        flags=re.S,
    )
    assert block is not None, f"{TUTORIAL} has no post-training-commands block"
    return block.group(1)


def shown_files() -> dict[str, str]:
    """``{name: text}`` of the tutorial's file blocks."""
    found = re.findall(
        r"<!-- file: (\S+) -->\n```\w+\n(.*?)```\n<!-- /file -->", TUTORIAL.read_text(), re.S
    )
    return dict(found)


def test_the_block_names_its_steps_and_its_files():
    """Every ``edl train`` of the block gives ``--steps`` (the default is the embedded job's
    1200), and every file it reads is shown."""
    runs = re.split(r"\n(?=edl )", commands())[1:]
    assert len(runs) == 3 and all("--steps" in r for r in runs), runs
    files = shown_files()
    assert set(files) == {"prefs.jsonl", "prompts.jsonl", "my_rewards.py"}
    for line in files["prefs.jsonl"].splitlines() + files["prompts.jsonl"].splitlines():
        json.loads(line)


def test_the_finetune_block_names_its_steps():
    trains = [r for r in re.split(r"\n(?=edl )", _commands()) if r.startswith("edl train")]
    assert trains and all("--steps" in r for r in trains), trains


@pytest.mark.slow  # three CLI runs on a 2-layer model, each compiling its steps (~3 minutes)
def test_post_training_commands_run_as_written(tmp_path):
    _build_model(tmp_path / "model")
    for name, text in shown_files().items():
        (tmp_path / name).write_text(text)
    script = commands()
    model_line = re.search(r"^MODEL=.*$", script, flags=re.M)
    assert model_line is not None, "the tutorial's block sets MODEL="
    out = _run(script.replace(model_line.group(0), f"MODEL={tmp_path / 'model'}"), tmp_path)

    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [int(s) for s in re.findall(r"--steps (\d+)", script)]
    assert [s["end_step"] for s in summaries] == steps
    assert all(s["stop_reason"] == "steps" and math.isfinite(s["final_loss"]) for s in summaries)
    for run, summary in zip(("dpo", "rm", "grpo"), summaries, strict=True):
        checkpoint = (
            tmp_path / "runs" / run / "checkpoints" / f"checkpoint-{summary['end_step']:08d}"
        )
        # LoRA DPO / GRPO checkpoints hold the adapters and a reference to the base; the
        # reward model (a new score head) keeps the full layout.
        held = "config.json" if run == "rm" else "adapter_config.json"
        assert (checkpoint / held).is_file(), sorted(checkpoint.iterdir())
        if run != "rm":
            base = json.loads((checkpoint / "state.json").read_text())["base"]
            assert base["source"] == str(tmp_path / "model")
            assert not (checkpoint / "model.safetensors").exists()
        log = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in log]
        assert metrics and all(isinstance(v, float | int) for m in metrics for v in m.values()), (
            metrics[-1]
        )
    reward_model = tmp_path / "runs/rm/checkpoints" / f"checkpoint-{steps[1]:08d}"
    config = json.loads((reward_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
