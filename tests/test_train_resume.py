"""edl.train's run directory: an earlier run is resumed exactly, deleted on request or
refused, never mixed; a corrupt newest checkpoint is skipped; kill -9 resumes bit-exactly."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from test_train_loop import _batches, _regression

import edl
from edl.io.checkpoint import latest_checkpoint, list_checkpoints
from edl.io.formats.safetensors import CheckpointError
from edl.train import RunConfig, make_train_step, train


class _Counted:
    """``_batches`` with a resumable position (the number of batches drawn)."""

    def __init__(self, n=100):
        self.count, self._all = 0, list(_batches(n))

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return self._all[self.count - 1]

    @property
    def position(self):
        return {"count": self.count}

    def restore(self, position):
        self.count = position["count"]


def _run(directory, steps, *, data=None, **kw):
    model, loss_fn = _regression()
    tx = optax.adam(1e-2)
    callbacks = kw.pop("callbacks", ())
    options = {"steps": steps, "output_dir": directory, "save_every": 2, "progress": False}
    return train(
        edl.create_state(model, tx),
        make_train_step(loss_fn, tx),
        data if data is not None else _Counted(),
        RunConfig.from_options({**options, **kw}),
        callbacks,
    )


def _lines(directory):
    return [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_refuses_a_directory_holding_an_earlier_run(tmp_path):
    _run(tmp_path, 6)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(
        FileExistsError, match=rf"{tmp_path} holds an earlier run.*--resume.*--overwrite"
    ):
        _run(tmp_path, 4, resume=False)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before

    _, summary = _run(tmp_path, 4, resume=False, overwrite=True)  # the old run is deleted
    assert summary["end_step"] == 4 and [m["step"] for m in _lines(tmp_path)] == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "checkpoint-00000002",
        "checkpoint-00000004",
    ]
    assert latest_checkpoint(tmp_path / "checkpoints").name == "checkpoint-00000004"
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / ".edl-overwritten-0badf00d" / "checkpoints").mkdir(parents=True)  # a kill
    _run(tmp_path, 2, resume=False, overwrite=True)  # mid-delete left this; it goes now
    assert not list(tmp_path.glob(".edl-*"))
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the run's own files go


def test_resume_cuts_the_log_back_and_reports_the_whole_run(tmp_path, caplog):
    """A run stopped at step 5 (checkpoints 2, 4 and 5 at its end), whose metrics.jsonl
    then gains lines no checkpoint covers (as a killed segment would leave): resuming to 8
    keeps one line per step, continues the time column and summarises all 8 steps."""
    caplog.set_level("INFO", logger="edl.train")
    _, first = _run(
        tmp_path,
        8,
        callbacks=[
            edl.train.callback(lambda info: edl.train.Stop("pause") if info.step == 5 else None)
        ],
    )
    assert first["stop_reason"] == "pause"
    lines = _lines(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a segment killed after checkpoint 5
        f.write(json.dumps({**lines[-1], "step": 6, "loss": -1.0}) + "\n")
        f.write('{"step": 7, "lo')  # cut mid-line by the kill
    state, summary = _run(tmp_path, 8)
    resumed = _lines(tmp_path)
    assert [m["step"] for m in resumed] == list(range(1, 9)) and -1.0 not in _losses(resumed)
    assert resumed[:5] == lines
    times = [m["time"] for m in resumed]
    assert times == sorted(times) and times[5] > times[4]
    assert summary["resumed_from"] == 5 and summary["start_step"] == 5
    assert summary["first_loss"] == lines[0]["loss"] and summary["end_step"] == 8
    assert summary["seconds"] > times[4] and int(state.step) == 8
    assert f"| first_loss | {lines[0]['loss']:.6g} |" in (tmp_path / "run.md").read_text()
    assert "resuming from checkpoint-00000005 (step 5)" in caplog.text
    assert "saved checkpoint-00000006 (step 6)" in caplog.text


def _losses(lines):
    return [m["loss"] for m in lines]


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, caplog, damage):
    caplog.set_level("INFO", logger="edl.train")
    _run(tmp_path, 6)
    newest = tmp_path / "checkpoints" / "checkpoint-00000006"
    if damage == "truncated":
        file = newest / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-10])
    else:
        (newest / "optimizer.safetensors").unlink()
    state, summary = _run(tmp_path, 8)
    assert summary["resumed_from"] == 4 and int(state.step) == 8
    assert "skipping checkpoint-00000006: " in caplog.text
    assert ("optimizer.safetensors" if damage == "missing" else "model.safetensors") in caplog.text
    assert "moved it to checkpoint-00000006.corrupt" in caplog.text
    assert (tmp_path / "checkpoints" / "checkpoint-00000006.corrupt").is_dir()
    assert [m["step"] for m in _lines(tmp_path)] == list(range(1, 9))
    assert latest_checkpoint(tmp_path / "checkpoints").name == "checkpoint-00000008"


def test_resume_with_no_whole_checkpoint_names_each_and_changes_nothing(tmp_path):
    _run(tmp_path, 4)
    for checkpoint in list_checkpoints(tmp_path / "checkpoints"):
        (checkpoint / "model.safetensors").write_bytes(b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"(?s)checkpoint-00000004: .*checkpoint-00000002: "):
        _run(tmp_path, 8)
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 2


def _script(*args):
    script = Path(__file__).with_name("train_script.py")
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_resume_after_kill_9_is_bit_identical_with_skipped_steps(tmp_path):
    """Train 8 steps straight; separately SIGKILL a run after step 5 (last checkpoint: step
    3), then resume it to step 8. Both runs skip the poisoned batch of step 2
    (``nan_policy="skip"``). The resumed run's losses of steps 4..8 are bit-identical, the
    log holds each step once, and the summary covers all 8 steps."""
    straight = _script(tmp_path / "straight", 8, "--poison", 2)
    killed = _script(tmp_path / "resumed", 8, "--poison", 2, "--kill-at", 5)
    code, out, err = _finish(straight)
    assert code == 0, err
    expected = json.loads(out.splitlines()[-1])
    code, _, err = _finish(killed)
    assert code == -signal.SIGKILL, err
    assert [m["step"] for m in _lines(tmp_path / "resumed")] == [1, 2, 3, 4, 5]
    code, out, err = _finish(_script(tmp_path / "resumed", 8, "--poison", 2))
    assert code == 0, err
    assert "resuming from checkpoint-00000003 (step 3)" in err
    summary = json.loads(out.splitlines()[-1])
    straight_lines, resumed_lines = _lines(tmp_path / "straight"), _lines(tmp_path / "resumed")
    assert [m["step"] for m in resumed_lines] == list(range(1, 9))
    assert _losses(resumed_lines) == _losses(straight_lines)  # bit for bit
    assert len(set(_losses(straight_lines))) == 8  # the losses do change step to step
    assert [m["skipped"] for m in resumed_lines] == [0, 1, 0, 0, 0, 0, 0, 0]
    assert np.isnan(resumed_lines[1]["loss"])
    for key in ("first_loss", "final_loss", "end_step", "skipped_steps"):
        assert summary[key] == expected[key], key
    assert summary["skipped_steps"] == 1 and summary["end_step"] == 8
    assert summary["resumed_from"] == 3 and expected["resumed_from"] is None
