"""The ``edl`` command: options with help and defaults, one-line errors before any work, runs
that never mix, ``edl info`` / ``edl generate`` on what a run leaves."""

import json
import os
import subprocess
import sys

import jax
import pytest

from edl.cli import main
from edl.cli.config import FIELDS, TrainConfig, default_of


def _fails(argv, capsys, code=2):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    return err


def test_every_flag_has_help_with_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, leaf in FIELDS.items():
        assert f"--{name.replace('_', '-')}" in text
        assert f"(default: {leaf.shown(default_of(leaf))})" in text, name
    assert "--optimizer TEXT optimizer: a name in edl.train.optimizers.OPTIMIZERS" in text
    assert "--nan-policy {stop,skip}" in text and "--schedule {cosine,linear,constant}" in text


def test_help_imports_no_jax():
    code = (
        "import sys\nfrom edl.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['generate', '--help'],\n"
        "             ['export', '--help'], ['generate', '--model', 'm', '--top-k', '0'],\n"
        "             ['serve', '--help'], ['serve', '--model', 'm', '--port', '-1']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]\n"
        "assert not {'starlette', 'uvicorn'} & set(sys.modules), 'the serve extra was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "adam"], "optimizer must be one of adamw, adafactor, lion, sgd, muon"),
        (["--sample-tokens", "0"], "sample_tokens must be >= 1, got 0"),
        (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--num-heads", "3"], "--num-heads (3) must divide --hidden-size (128)"),
        (["--resume", "--overwrite"], "resume and overwrite exclude each other"),
        (["--lora-rank", "8"], "--lora-rank needs --model"),
        (["--model", "m"], "--model needs --data"),
        (["--data", "d.jsonl", "--format", "chat"], "--format chat needs --model"),
        (["--model", "m", "--data", "d", "--quantize", "nf4"], "it needs --lora-rank"),
        (["--eval-data", "e.jsonl"], "--eval-data needs --data"),
        (["--format", "json"], "invalid choice: 'json' (choose from 'text', 'completion'"),
        (["--trackers", "mlflow"], "trackers: 'mlflow' is not one of tensorboard, wandb"),
        (["--profile", "3"], "profile must be START:COUNT"),
        (["--profile", "0:2"], "profile must be START:COUNT"),
        (["--keep", "-1"], "keep must be >= 0, got -1"),
    ],
)
def test_invalid_flags_fail_before_any_work_in_one_line(tmp_path, capsys, argv, message):
    err = _fails(["train", "--output-dir", str(tmp_path / "run"), *argv], capsys)
    assert err.startswith("edl train: error: ") and message in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('steps = "ten"', "steps must be an int, got 'ten'"),
        ("learning_rate = true", "learning_rate must be a float, got True"),
        ("nope = 1", "unknown option 'nope'"),
        ("steps = [", "not valid TOML"),
    ],
)
def test_a_bad_toml_file_fails_naming_the_file_and_key(tmp_path, capsys, toml, message):
    config = tmp_path / "run.toml"
    config.write_text(toml + "\n")
    err = _fails(["train", "--config", str(config)], capsys)
    assert f"{config}: " in err and message in err


def test_info_and_generate_on_a_missing_path_exit_nonzero(tmp_path, capsys):
    err = _fails(["info", str(tmp_path / "nope")], capsys, code=1)
    assert f"{tmp_path / 'nope'} does not exist" in err
    err = _fails(["generate", "--model", str(tmp_path / "nope")], capsys, code=1)
    assert "does not exist" in err
    assert "--max-new-tokens: must be >= 1" in _fails(
        ["generate", "--model", str(tmp_path), "--max-new-tokens", "0"], capsys
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "a", "--prompt-file", "f"], "not allowed with argument --prompt"),
        (["--top-p", "1.5", "--temperature", "1"], "--top-p: must be in (0, 1], got 1.5"),
        (["--top-k", "0", "--temperature", "1"], "--top-k: must be >= 1, got 0"),
        (["--top-k", "5"], "--top-k: only applies when sampling (--temperature > 0)"),
        (["--num-beams", "0"], "--num-beams: must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature: must be >= 0, got -1.0"),
        (["--system", "be brief"], "--system: needs --chat"),
        (["--chat"], "--chat: needs --prompt or --prompt-file"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read /nonexistent/prompt.txt"),
    ],
)
def test_generate_usage_errors_exit_2_in_one_line(tmp_path, capsys, argv, message):
    err = _fails(["generate", "--model", str(tmp_path), *argv], capsys)
    assert err.startswith("edl generate: error: ") and message in err


def test_export_errors_name_the_path(tmp_path, capsys):
    assert "required: OUT_DIR" in _fails(["export", str(tmp_path)], capsys)
    err = _fails(["export", str(tmp_path / "nope"), str(tmp_path / "out")], capsys, code=1)
    assert f"{tmp_path / 'nope'} does not exist" in err


def test_defaults_are_valid_and_sized_by_steps():
    config = TrainConfig()
    run = config.run
    assert run.steps > 0 and run.time_limit.seconds >= 4 * 240  # the limit is a safety net
    assert config.warmup_steps < run.steps and run.eval.every <= run.steps


def test_train_with_toml_and_flags_then_resume_refuse_overwrite_info_generate(tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        f'output_dir = "{run}"\nsteps = 3\nhidden_size = 32\nintermediate_size = 64\n'
        "num_layers = 1\ncorpus_bytes = 200000\neval_every = 2\neval_batches = 1\n"
        "seq_len = 32\nbatch_size = 2\nsample_tokens = 8\n"
    )
    old = os.umask(0o022)
    try:
        main(
            [
                "train",
                "--config",
                str(config),
                "--steps",
                "4",
                "--save-every",
                "2",
                "--trackers",
                "none",
                "--profile",
                "2:1",
            ]
        )
    finally:
        os.umask(old)
    captured = capsys.readouterr()
    summary = json.loads(captured.out.splitlines()[0])
    assert summary["end_step"] == 4 and summary["final_bits_per_byte"] > 0
    assert summary["final_eval_step"] == 4 and 0 < summary["eval_bits_per_byte"] < 8.5
    assert "--- sample" in captured.out
    assert "step 2/4: eval_" in captured.err and "eval_bits_per_byte" in captured.err
    assert "saved checkpoint-00000004 (step 4)" in captured.err
    for written in (
        run / "run.md",
        run / "checkpoints" / "checkpoint-00000004" / "config.json",
        run / "metrics.jsonl",
        run / "checkpoints" / "checkpoint-00000004" / "model.safetensors",
    ):
        assert written.stat().st_mode & 0o777 == 0o644, written  # the umask, not 0o600
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("bits_per_byte" in m for m in lines)
    assert not (run / "tensorboard").exists() and any((run / "profile").rglob("*.xplane.pb"))
    # run.md records every option in effect; read back, they are the run's configuration.
    recorded = json.loads((run / "run.md").read_text().split("```json\n")[1].split("```")[0])
    assert f"{jax.device_count()} x cpu" in recorded["environment"]["devices"]
    assert recorded["environment"]["versions"]["jax"] == jax.__version__
    assert recorded["options"]["learning_rate"] == 2e-3  # the rate used, not the 0 default
    again = TrainConfig.from_options(recorded["options"])
    assert again.run.steps == 4 and again.run.checkpoint.every == 2 and again.hidden_size == 32
    assert again.run.log.trackers == () and again.run.profile.steps == (2, 1)
    assert again.run.throughput.flops_per_token > 0  # measured from the model, recorded

    err = _fails(["train", "--config", str(config)], capsys, code=1)  # the run exists
    assert f"{run} holds an earlier run" in err and "--resume" in err and "--overwrite" in err
    main(["train", "--config", str(config), "--steps", "6", "--resume"])
    captured = capsys.readouterr()
    assert "resuming from checkpoint-00000004 (step 4)" in captured.err
    assert json.loads(captured.out.splitlines()[0])["end_step"] == 6
    main(["train", "--config", str(config), "--steps", "2", "--overwrite"])
    assert json.loads(capsys.readouterr().out.splitlines()[0])["end_step"] == 2
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]

    main(["info", str(run)])
    shown = capsys.readouterr().out
    assert "checkpoint-00000002" in shown
    # What the run used and where it ended, from run.md and metrics.jsonl.
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"run {run}: the embedded byte-level model, method sft" in shown
    assert f"jax {jax.__version__}" in shown
    assert f"final step 2: loss={last['loss']:.6g}" in shown
    main(["generate", "--model", str(run), "--prompt", "import", "--max-new-tokens", "5"])
    captured = capsys.readouterr()
    assert captured.out.startswith("import")
    # The wait for the first token (the decode loop's compile) is said on stderr, not stdout.
    said = captured.err.splitlines()
    assert said[0] == "edl generate: compiling the decode loop (and the first token) ..."
    assert said[1].startswith("edl generate: the decode loop (and the first token) ready in ")


def test_info_reports_the_run_main_numbers_and_last_evaluation(tmp_path):
    """``edl info``'s run lines from a GRPO-like run's files: the model and method used, the
    method's main number before the loss, the last evaluation; a kill's partial line is skipped
    and any other broken line is named."""
    from edl.cli.config import CommandError
    from edl.cli.info import run_report
    from edl.train.callbacks.run_report import write_run_summary

    record = {
        "options": {"model": "HuggingFaceTB/SmolLM2-135M", "method": "grpo"},
        "environment": {"devices": "8 x cpu (cpu)", "mesh": {"data": 8}, "versions": {"jax": "9"}},
    }
    write_run_summary(tmp_path / "run.md", {"end_step": 3}, record)
    lines = [
        {"step": 1, "loss": 0.5, "reward_mean": 0.25},
        {"step": 2, "loss": 0.4, "eval_loss": 1.5, "eval_accuracy": 0.5},
        {"step": 3, "loss": 1e-6, "reward_mean": 0.75, "tokens_per_s": 9.0},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 4, "lo')
    assert run_report(tmp_path) == [
        f"run {tmp_path}: HuggingFaceTB/SmolLM2-135M, method grpo",
        "  devices 8 x cpu (cpu), mesh {'data': 8}; jax 9",
        "  final step 3: reward_mean=0.75, loss=1e-06",
        "  final evaluation (step 2): eval_accuracy=0.5, eval_loss=1.5",
    ]
    metrics.write_text('{"step": 1\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(CommandError, match=r"metrics.jsonl: line 1 is not JSON"):
        run_report(tmp_path)
    assert run_report(tmp_path / "nothing") == []
