"""``edl info``: what a run directory, checkpoint or saved model holds."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edl.cli.config import CommandError
from edl.io.checkpoint import STATE_NAME, list_checkpoints, verify_checkpoint
from edl.io.checkpoint.sharded import INDEX_NAME as SHARDS_INDEX
from edl.io.checkpoint.sharded import read_index
from edl.io.formats.files import read_json
from edl.io.formats.hf import CONFIG_NAME
from edl.io.formats.safetensors import CheckpointError

__all__ = ["model_line", "resolve_model", "run_info", "run_report"]


def _checkpoints_dir(path: Path) -> Path:
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def resolve_model(path: Path) -> Path:
    """The model directory behind ``path``: a run directory's or checkpoint directory's newest
    checkpoint whose files are whole (newer corrupt ones are reported on stderr and skipped),
    a checkpoint, or a saved model. ``CommandError`` when there is none."""
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / STATE_NAME).is_file():  # a checkpoint (an adapter-only one has no config)
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            raise CommandError(str(e)) from None
        return path
    for checkpoint in reversed(list_checkpoints(_checkpoints_dir(path))):
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as e:
            print(f"skipping {checkpoint.name}: {e}", file=sys.stderr)
            continue
        return checkpoint
    raise CommandError(
        f"{path} holds no model: neither a {CONFIG_NAME} nor a whole checkpoint with one"
    )


def _shown(record: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k}={record[k]:.6g}" for k in keys if isinstance(record.get(k), float | int))


def run_report(path: Path) -> list[str]:
    """What a run directory says of its run, from ``run.md`` (written at the end: the model,
    method, devices, mesh and versions used) and ``metrics.jsonl`` (every logged step: the
    final loss and each method's main number, and the last evaluation). ``[]`` for a path
    that is no run directory."""
    from edl.train.callbacks.metrics_log import METRICS_FILE
    from edl.train.callbacks.progress import SHOWN
    from edl.train.callbacks.run_report import read_run_record
    from edl.train.run_dir import read_history

    try:
        record = read_run_record(path / "run.md")
        history = read_history(path / METRICS_FILE)
    except ValueError as e:
        raise CommandError(str(e)) from None
    lines = []
    if record is not None:
        options, environment = record.get("options", {}), record.get("environment", {})
        model = options.get("model") or "the embedded byte-level model"
        lines.append(f"run {path}: {model}, method {options.get('method')}")
        versions = ", ".join(f"{k} {v}" for k, v in environment.get("versions", {}).items())
        lines.append(
            f"  devices {environment.get('devices')}, mesh {environment.get('mesh')}; {versions}"
        )
    trained = [m for m in history if "loss" in m]
    if trained:
        last = trained[-1]
        main = [k for k in SHOWN if k not in ("tokens_per_s", "mfu")] + ["bits_per_byte"]
        numbers = _shown(last, main)
        lines.append(f"  final step {last.get('step')}: {numbers}")
    evals = [m for m in history if any(k.startswith("eval_") for k in m)]
    if evals:
        keys = sorted(k for k in evals[-1] if k.startswith("eval_"))
        lines.append(
            f"  final evaluation (step {evals[-1].get('step')}): {_shown(evals[-1], keys)}"
        )
    return lines


def run_info(path: Path) -> None:
    """Print what a run did (:func:`run_report`), its checkpoints (the newest's state.json),
    the model's architecture features (``edl.models.features``) and its summary."""
    import edl
    from edl.io.export import load_model

    if not path.exists():
        raise CommandError(f"{path} does not exist")
    for line in run_report(path):
        print(line)
    found = list_checkpoints(_checkpoints_dir(path))
    if found:
        print(f"{_checkpoints_dir(path)}: {len(found)} checkpoint(s); newest {found[-1].name}")
        info = read_json(found[-1] / STATE_NAME, what="checkpoint state")
        print(json.dumps({k: v for k, v in info.items() if k != "metadata"}, indent=2))
    model_dir = resolve_model(path)
    if (model_dir / SHARDS_INDEX).is_file():
        print(_sharded_summary(model_dir))
        return
    try:
        model = load_model(model_dir)  # an adapter-only checkpoint: its base is found first
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    line = model_line(model)
    if line:
        print(line)
    print(edl.summary(model))


def model_line(model: Any) -> str | None:
    """``"<HF architecture> (model_type <t>): <feature>; <feature>; ..."`` for a decoder, or
    a model nesting one (LLaVA: its language model's features; ``edl.models.features``);
    ``None`` for other models (vision towers)."""
    from edl.models.config import DecoderConfig
    from edl.models.features import features
    from edl.models.registry import architecture

    config = getattr(model, "config", None)
    described = features(config)
    if not described:
        return None
    name = architecture(model) if isinstance(config, DecoderConfig) else type(model).__name__
    return f"{name} (model_type {config.model_type}): " + "; ".join(described)


def _sharded_summary(checkpoint: Path) -> str:
    """A sharded checkpoint's model in one line, from its index (no tensor is read)."""
    index = read_index(checkpoint)
    shapes = [entry.shape for entry in index.section("model").values()]
    count = sum(math.prod(shape) for shape in shapes)
    architecture = "a pytree"
    if (checkpoint / CONFIG_NAME).is_file():
        config = read_json(checkpoint / CONFIG_NAME, what="model config")
        architecture = config.get("architectures", ["a model"])[0]
    return (
        f"{architecture}: {count:,} parameters in {len(shapes)} arrays, sharded over "
        f"{index.process_count} process(es) (edl export writes it as one HF "
        f"model)"
    )
