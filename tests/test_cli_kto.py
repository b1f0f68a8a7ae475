"""Unpaired preference data (``prompt`` / ``completion`` / ``label``) and ``edl train
--method kto``: records tokenized as TRL's, batches with the mismatched KL rows, resumable;
the command trains and resumes bit-exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edl.cli.config import ConfigError, TrainConfig
from edl.text import ByteTokenizer, encode_preference
from edl.train.kto_data import KTOBatches, encode_unpaired
from tests.test_finetune_readme import CONVERSATIONS, _build_model

transformers = pytest.importorskip("transformers")


def test_unpaired_records_batch_with_the_previous_completion_as_kl_rows():
    tok = ByteTokenizer()
    records = [
        {"prompt": f"q{i}? ", "completion": "yes" if i % 2 else "no!", "label": bool(i % 2)}
        for i in range(6)
    ]
    docs = [encode_unpaired(tok, r) for r in records]
    pair = encode_preference(tok, {"prompt": "q0? ", "chosen": "no!", "rejected": "no!"})
    np.testing.assert_array_equal(docs[0]["completion_ids"], pair["chosen_ids"])  # TRL's ids
    data = KTOBatches(docs, batch_size=3, max_length=16, pad_id=0, shuffle=False)
    batch = next(data)
    assert batch["label"].tolist() == [False, True, False]
    text = lambda ids, labels: bytes(ids[labels != -100].tolist()[:-1]).decode()  # no EOS
    completions = [text(batch["input_ids"][r], batch["labels"][r]) for r in range(3)]
    kl = [text(batch["kl_input_ids"][r], batch["kl_labels"][r]) for r in range(3)]
    assert completions == ["no!", "yes", "no!"] and kl == ["no!", "no!", "yes"]
    prompts = [bytes(batch["kl_input_ids"][r][:4].tolist()).decode() for r in range(3)]
    assert prompts == ["q0? ", "q1? ", "q2? "]  # each prompt keeps its row
    position = data.position
    after = next(data)
    data.restore(position)
    for key, value in next(data).items():
        np.testing.assert_array_equal(value, after[key], err_msg=key)
    with pytest.raises(ValueError, match=r"documents\[1\]: 'label' must be true"):
        encode_unpaired(tok, {**records[1], "label": "yes"}, where="documents[1]")
    with pytest.raises(ValueError, match="at least 2 rows per process"):
        KTOBatches(docs, batch_size=1, max_length=16, pad_id=0)


def test_kto_options_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="--method kto needs --model"):
        TrainConfig(method="kto")
    with pytest.raises(ConfigError, match="desirable_weight must be >= 0"):
        TrainConfig(method="kto", model="m", data="d", desirable_weight=-1.0)
    config = TrainConfig(method="kto", model="m", data="d", undesirable_weight=0.5)
    assert config.in_effect()["undesirable_weight"] == 0.5
    assert "desirable_weight" not in TrainConfig(method="dpo", model="m", data="d").in_effect()


def _unpaired(path) -> None:
    with path.open("w") as f:
        for i in range(12):
            ((user, good),) = CONVERSATIONS[i % len(CONVERSATIONS)]
            bad = CONVERSATIONS[(i + 1) % len(CONVERSATIONS)][0][1]
            record = {
                "prompt": [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": good if i % 2 else bad}],
                "label": bool(i % 2),
            }
            f.write(json.dumps(record) + "\n")


@pytest.mark.slow  # three CLI runs that each compile a KTO step (~1-2 minutes)
def test_kto_from_the_command_line_trains_and_resumes_exactly(tmp_path, capsys):
    from edl.cli import main

    _build_model(tmp_path / "model")
    _unpaired(tmp_path / "unpaired.jsonl")
    common = [
        "train",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(tmp_path / "unpaired.jsonl"),
        "--method",
        "kto",
        "--batch-size",
        "4",
        "--seq-len",
        "48",
        "--warmup-steps",
        "0",
        "--schedule",
        "constant",  # the same learning rates in a run of 6 steps and one of 10
        "--learning-rate",
        "5e-3",
        "--lora-rank",
        "8",
        "--steps",
        "10",
        "--save-every",
        "4",
        "--no-progress",
    ]
    main([*common, "--output-dir", str(tmp_path / "whole")])
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert whole["end_step"] == 10 and whole["final_loss"] < whole["first_loss"]
    assert abs(whole["first_rewards/margins"]) < 1e-5 < whole["final_rewards/margins"]

    main([*common, "--output-dir", str(tmp_path / "split"), "--steps", "6"])
    capsys.readouterr()
    main([*common, "--output-dir", str(tmp_path / "split"), "--resume"])
    capsys.readouterr()
    lines = lambda d: [
        json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["loss"] for m in lines("split")] == [m["loss"] for m in lines("whole")]
