"""``train``'s trackers (TensorBoard, Weights & Biases offline), its profile option, and
that in a multi-process run only process 0 writes the run's logs.

Both trackers' files are read back with their own record formats: TensorBoard's TFRecord
events (``tensorboardX``'s ``Event`` proto) and W&B's run file (its LevelDB-style log of
``wandb_internal_pb2.Record``), so what a researcher would see is what is checked."""

import json
import struct

import jax
import pytest
from test_train_loop import _lines, _run

from edl.cli.config import TrainConfig
from edl.train import LogConfig


def _tensorboard_events(directory):
    """``(scalars {tag: {step: value}}, texts {tag: text})`` of the event files."""
    from tensorboardX.proto.event_pb2 import Event

    scalars, texts = {}, {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: length, its crc, the record, its crc
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("tensor") and value.tensor.string_val:
                    texts[value.tag] = value.tensor.string_val[0].decode()
                else:
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars, texts


def _wandb_records(run_file):
    """The ``Record`` protos of a W&B run file: a 7-byte header, then 32 KiB blocks of
    (crc32, length, type) framed chunks, a record split across blocks as first / middle /
    last chunks."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", run_file
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last chunk
            records.append(Record.FromString(pending))
    return records


def _wandb_run(directory):
    """``(history {step: {key: value}}, config {key: value}, run ids)`` over every W&B run
    file under ``directory/wandb``."""
    history, config, ids = {}, {}, set()
    for run_file in sorted((directory / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                updates = list(record.run.config.update)
            elif kind == "config":
                updates = list(record.config.update)
            else:
                updates = []
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history.setdefault(items.pop("_step"), {}).update(items)
    return history, config, ids


def test_tensorboard_logs_the_metrics_and_the_config(tmp_path, capsys):
    _run(tmp_path, steps=4, trackers=("tensorboard",), record={"what": "test"})
    assert f"tensorboard --logdir {tmp_path / 'tensorboard'}" in capsys.readouterr().err
    scalars, texts = _tensorboard_events(tmp_path / "tensorboard")
    losses = {m["step"]: m["loss"] for m in _lines(tmp_path)}
    assert scalars["loss"] == pytest.approx(losses, rel=1e-6)  # float32 in the event
    assert '"what": "test"' in texts["config/text_summary"]


def test_no_trackers_writes_only_the_metrics_log(tmp_path):
    _run(tmp_path, steps=2, trackers=())
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_wandb_offline_logs_metrics_and_config_and_a_resume_continues_its_run(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run(tmp_path, steps=4, save_every=2, trackers=("wandb",), record={"what": "test"})
    _run(tmp_path, steps=6, trackers=("wandb",), record={"what": "test"})  # resumes at 4
    history, config, ids = _wandb_run(tmp_path)
    lines = {m["step"]: m for m in _lines(tmp_path)}
    assert sorted(history) == sorted(lines) == [1, 2, 3, 4, 5, 6]
    for step, line in lines.items():
        assert history[step]["loss"] == line["loss"]  # JSON both ways: exact
    assert config["what"] == "test"
    assert len(ids) == 1  # the resumed run is the same W&B run


def test_unknown_trackers_and_bad_profiles_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="trackers: 'mlflow' is not one of tensorboard, wandb"):
        _run(tmp_path, trackers=("mlflow",))
    # A string is no tuple of names (under the suite's hook, the annotation answers first).
    with pytest.raises((ValueError, TypeError), match="trackers"):
        LogConfig(trackers="tensorboard")
    with pytest.raises(ValueError, match="profile must be"):
        _run(tmp_path, profile=(0, 2))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_profile_traces_the_chosen_steps(tmp_path):
    _run(tmp_path, steps=4, profile=(2, 2))
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert [m["step"] for m in _lines(tmp_path)] == [1, 2, 3, 4]


def test_only_process_zero_writes_the_run_logs(tmp_path, monkeypatch):
    """Another process of a multi-process run keeps its history (its summary) but writes no
    metrics log, tracker files, report, plot or profile."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    _, summary = _run(tmp_path, steps=3, trackers=("tensorboard",), profile=(1, 1))
    assert summary["final_loss"] is not None and summary["end_step"] == 3
    written = {p.name for p in tmp_path.iterdir()}
    assert not written & {"metrics.jsonl", "tensorboard", "run.md", "loss.png", "profile"}


@pytest.mark.parametrize(
    ("trackers", "names"),
    [("auto", None), ("none", ()), ("tensorboard, wandb", ("tensorboard", "wandb"))],
)
def test_cli_parses_trackers_and_profile(trackers, names):
    """The CLI's strings as ``train`` takes them (bad ones: tests/test_cli.py)."""
    assert TrainConfig.from_options({"trackers": trackers}).run.log.trackers == names
    assert TrainConfig.from_options({"profile": "10:3"}).run.profile.steps == (10, 3)
