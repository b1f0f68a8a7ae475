"""``edl train --method distill --teacher DIR``: options checked before any work, GKD records
(messages or prompt / completion) read, a student distilled on- and off-policy from a wider
teacher, trained and resumed bit-exactly."""

from __future__ import annotations

import json

import pytest

from edl.cli.config import ConfigError, TrainConfig
from tests.test_finetune_readme import CONVERSATIONS, _build_model

transformers = pytest.importorskip("transformers")


def test_distill_options_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="--method distill needs --model"):
        TrainConfig(method="distill", teacher="t")
    with pytest.raises(ConfigError, match="--teacher is for --method distill, which needs it"):
        TrainConfig(method="distill", model="m", data="d")
    with pytest.raises(ConfigError, match="--teacher is for --method distill"):
        TrainConfig(method="dpo", model="m", data="d", teacher="t")
    with pytest.raises(ConfigError, match=r"0 <= --beta <= 1 .* got 1\.5"):
        TrainConfig(method="distill", model="m", data="d", teacher="t", beta=1.5)
    with pytest.raises(ConfigError, match="lmbda"):
        TrainConfig(method="distill", model="m", data="d", teacher="t", lmbda=1.5)
    config = TrainConfig(method="distill", model="m", data="d", teacher="t", lmbda=0.5)
    assert config.in_effect()["lmbda"] == 0.5 and config.in_effect()["teacher"] == "t"
    assert "lmbda" not in TrainConfig(method="kto", model="m", data="d").in_effect()


def test_a_distill_record_of_the_wrong_shape_is_refused_naming_the_file(tmp_path):
    from edl.cli.checks import check_data

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(Exception, match=r"bad.jsonl:1.*at least 2 chat messages"):
        check_data(str(path), "distill", flag="--data")


def _records(path) -> None:
    with path.open("w") as f:
        for i in range(12):
            ((user, answer),) = CONVERSATIONS[i % len(CONVERSATIONS)]
            if i % 2:
                messages = [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
            else:
                f.write(json.dumps({"prompt": user + " ", "completion": answer}) + "\n")


@pytest.mark.slow  # three CLI runs that sample and compile distill steps (~2-3 minutes)
def test_distill_from_the_command_line_trains_and_resumes_exactly(tmp_path, capsys):
    from edl.cli import main

    _build_model(tmp_path / "model")
    _build_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192)
    _records(tmp_path / "gkd.jsonl")
    common = [
        "train",
        "--model",
        str(tmp_path / "model"),
        "--teacher",
        str(tmp_path / "teacher"),
        "--data",
        str(tmp_path / "gkd.jsonl"),
        "--method",
        "distill",
        "--beta",
        "0.5",
        "--lmbda",
        "0.5",
        "--max-new-tokens",
        "4",
        "--batch-size",
        "4",
        "--seq-len",
        "48",
        "--warmup-steps",
        "0",
        "--schedule",
        "constant",  # the same learning rates in a run of 4 steps and one of 8
        "--learning-rate",
        "5e-3",
        "--steps",
        "8",
        "--save-every",
        "4",
        "--no-progress",
    ]
    main([*common, "--output-dir", str(tmp_path / "whole")])
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert whole["end_step"] == 8 and whole["final_loss"] < whole["first_loss"]
    main([*common, "--output-dir", str(tmp_path / "split"), "--steps", "4"])
    capsys.readouterr()
    main([*common, "--output-dir", str(tmp_path / "split"), "--resume"])
    capsys.readouterr()
    lines = lambda d: [
        json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
    ]
    steps = lambda d: [m for m in lines(d) if "loss" in m]
    assert {m["on_policy"] for m in steps("whole")} == {0.0, 1.0}  # both kinds of step ran
    assert [m["loss"] for m in steps("split")] == [m["loss"] for m in steps("whole")]
