"""Checkpoints written in the background (``CheckpointConfig(asynchronous=True)``, the
``--save-async`` flag): the same files as a synchronous save although the steps go on and
donate the state, one save at a time, and a failed background save fails the run."""

import filecmp
import threading

import pytest
from test_train_loop import _lines, _run

from edl.train.callbacks import checkpoint as checkpoint_module


def _files(run):
    return {p.relative_to(run): p for p in (run / "checkpoints").rglob("*") if p.is_file()}


def test_async_checkpoints_equal_synchronous_ones(tmp_path):
    _run(tmp_path / "sync", steps=7, save_every=2, keep=0)
    _run(tmp_path / "async", steps=7, save_every=2, keep=0, save_async=True)
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(sync) == sorted(background)
    assert {p.parent.name for p in sync} == {f"checkpoint-0000000{i}" for i in (2, 4, 6, 7)}
    for name, path in sync.items():
        if name.name != "state.json":  # it records the elapsed time
            assert filecmp.cmp(path, background[name], shallow=False), name
    losses = [[(m["step"], m["loss"]) for m in _lines(tmp_path / d)] for d in ("sync", "async")]
    assert losses[0] == losses[1]


def test_one_background_save_at_a_time_and_the_run_waits_for_the_last(tmp_path, monkeypatch):
    real, running, overlaps, done = checkpoint_module.save_state, [], [], []

    def slow_save(state, directory, **kw):
        overlaps.append(len(running))
        running.append(threading.current_thread().name)
        threading.Event().wait(0.2)  # the loop runs ahead meanwhile
        path = real(state, directory, **kw)
        running.pop()
        done.append(path.name)
        return path

    monkeypatch.setattr(checkpoint_module, "save_state", slow_save)
    _run(tmp_path, steps=6, save_every=1, save_async=True)
    assert overlaps == [0] * 6 and done[-1] == "checkpoint-00000006"
    assert (tmp_path / "checkpoints" / "checkpoint-00000006" / "state.json").exists()


def test_a_failed_background_save_fails_the_run(tmp_path, monkeypatch):
    real = checkpoint_module.save_state

    def failing(state, directory, **kw):
        if int(state.step) == 4:
            raise OSError("disk full (test)")
        return real(state, directory, **kw)

    monkeypatch.setattr(checkpoint_module, "save_state", failing)
    with pytest.raises(OSError, match="disk full"):
        _run(tmp_path, steps=6, save_every=2, save_async=True)
    assert (tmp_path / "checkpoints" / "checkpoint-00000002" / "state.json").exists()


def test_write_share_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"write_share must be in \(0, 1\], got 0\.0"):
        checkpoint_module.Checkpoint(tmp_path, asynchronous=True, write_share=0.0)
