"""``RunConfig`` and the settings objects behind it (``edl._settings``): nested configs that
check themselves, flat option names shared with the ``edl train`` flags and TOML keys, and
round trips through ``to_options`` / ``from_options``, TOML and ``run.md``."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest

from edl._settings import ConfigError, leaves, option
from edl.cli.config import EMBEDDED_RUN, FIELDS, TrainConfig, read_toml, write_toml
from edl.train import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    NonFiniteConfig,
    ProfileConfig,
    RunConfig,
    ThroughputConfig,
    TimeLimitConfig,
)


def _nested() -> RunConfig:
    return RunConfig(
        steps=40,
        output_dir="run",
        resume=False,
        checkpoint=CheckpointConfig(every=10, keep=0, asynchronous=True),
        eval=EvalConfig(every=5, batches=2),
        log=LogConfig(every=2, stats_every=4, trackers=("tensorboard",), progress=False),
        throughput=ThroughputConfig(flops_per_token=6e6, peak_flops=1e12),
        nonfinite=NonFiniteConfig(policy="skip", max_consecutive_skips=3),
        time_limit=TimeLimitConfig(seconds=60.0),
        profile=ProfileConfig(steps=(3, 2)),
    )


def test_flat_options_build_the_nested_config_and_read_back():
    flat = {
        "steps": 40,
        "output_dir": "run",
        "resume": False,
        "save_every": 10,
        "keep": 0,
        "save_async": True,
        "eval_every": 5,
        "eval_batches": 2,
        "log_every": 2,
        "stats_every": 4,
        "trackers": "tensorboard",  # the flag's text form
        "progress": False,
        "flops_per_token": 6e6,
        "peak_flops": 1e12,
        "nan_policy": "skip",
        "max_consecutive_skips": 3,
        "time_limit": 60.0,
        "profile": "3:2",
    }
    run = RunConfig.from_options(flat)
    assert run == _nested()
    options = run.to_options()
    assert options["trackers"] == ["tensorboard"] and options["profile"] == [3, 2]
    assert RunConfig.from_options(options) == run  # lists (JSON / TOML) read back as tuples
    assert set(options) == set(leaves(RunConfig))  # every option, by its one name


def test_every_run_option_is_an_edl_train_flag_with_the_same_declaration():
    """The CLI derives its run flags from ``RunConfig``'s fields: same name, help, range."""
    for name, leaf in leaves(RunConfig).items():
        assert FIELDS[name].spec == leaf.spec and FIELDS[name].path == ("run", *leaf.path)
    assert TrainConfig().run == EMBEDDED_RUN  # the CLI's defaults: one RunConfig value
    assert EMBEDDED_RUN.resume is False and RunConfig(steps=1).resume is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": -1}, "steps must be >= 0, got -1"),
        ({"steps": 2.0}, "steps must be an int, got 2.0"),
        ({"steps": True}, "steps must be an int, got True"),  # a bool is no int
        ({"steps": 1, "peak_flops": math.nan}, "peak_flops must be finite, got nan"),
        ({"steps": 1, "time_limit": math.inf}, "time_limit must be finite, got inf"),
        ({"steps": 1, "nan_policy": "ignore"}, "nan_policy must be one of stop, skip"),
        ({"steps": 1, "profile": "3"}, "profile must be START:COUNT"),
        ({"steps": 1, "profile": [1]}, "profile must be a tuple"),
        ({"steps": 1, "trackers": "mlflow"}, "trackers: 'mlflow' is not one of"),
        ({"steps": 1, "save_every": 5}, "save_every > 0 needs an output_dir"),
        ({"steps": 1, "profile": "1:1"}, "profile needs an output_dir"),
        ({"steps": 1, "output_dir": "o", "overwrite": True}, "resume and overwrite exclude"),
        ({"steps": 1, "output_dir": ""}, "output_dir is empty"),
        ({"steps": 1, "output_dir": b"run"}, "output_dir must be a str"),
        ({"steps": 1, "save-every": 5}, "unknown option 'save-every'; options: eval_batches"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        RunConfig.from_options(options)


def test_a_section_checks_itself_when_made():
    with pytest.raises((ConfigError, TypeError), match="every"):
        CheckpointConfig(every=-2)
    with pytest.raises((ConfigError, TypeError), match="batches"):
        EvalConfig(batches=0)
    run = dataclasses.replace(RunConfig(steps=3), eval=EvalConfig(every=1))
    assert run.eval.every == 1 and RunConfig(steps=3).eval.every == 0  # frozen values


def test_train_config_round_trips_through_toml_and_its_record(tmp_path):
    config = TrainConfig.from_options(
        {
            "steps": 7,
            "save_every": 3,
            "trackers": "none",
            "profile": "2:1",
            "prompt": 'a "quoted"\n\\ prompt\x7f',
            "learning_rate": 1e-3,
            "output_dir": str(tmp_path / "run"),
        }
    )
    assert TrainConfig.from_options(config.to_options()) == config  # run.md's record
    path = tmp_path / "run.toml"
    write_toml(config, path)
    tomllib.loads(path.read_text())  # valid TOML
    assert TrainConfig.from_options(read_toml(path)) == config
    path.write_text("nope = 1\n")
    with pytest.raises(ConfigError, match=f"{path}: unknown option 'nope'"):
        read_toml(path)


@dataclasses.dataclass(frozen=True)
class _Inner:
    every: int = option(1, "inner", name="save_every")


@dataclasses.dataclass(frozen=True)
class _Outer:
    save_every: int = option(1, "outer")
    inner: _Inner = _Inner()


def test_two_options_may_not_share_a_name():
    with pytest.raises(TypeError, match="option name 'save_every' is used twice"):
        leaves(_Outer)


def test_the_record_holds_the_options_in_effect():
    """run.md records what shaped the run: the learning rate used, and none of the options
    of another kind of run (issue 46: a --model run listed the byte model's size)."""
    embedded = TrainConfig().in_effect()
    assert embedded["learning_rate"] == 2e-3 and embedded["hidden_size"] == 128
    assert "loss_type" not in embedded and "num_generations" not in embedded
    assert "lora_alpha" not in embedded  # no --lora-rank: no LoRA scaling
    options = {"model": "m", "data": "d.jsonl", "method": "dpo", "lora_rank": 8}
    dpo = TrainConfig.from_options(options).in_effect()
    assert dpo["learning_rate"] == 2e-4 and dpo["loss_type"] == "sigmoid"
    assert dpo["lora_alpha"] == 16.0 and "num_generations" not in dpo
    assert not {"hidden_size", "corpus_bytes", "prompt"} & set(dpo)
    assert TrainConfig.from_options(dpo).in_effect() == dpo  # the same run again
