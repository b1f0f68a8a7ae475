"""Checks before work (``edl train``): what can be known wrong before a model loads or a batch
is read, each answered in one line.

``check_before_work`` runs right after jax starts (``edl.cli.distributed.start``) and before
any model or data is loaded, for every ``--method``: the ``--mesh`` against the devices
present (``ConfigError``: exit 2), ``--mesh`` with a post-training method, the output
directory, ``--model`` / ``--teacher`` and ``--data`` / ``--eval-data`` paths (a
path-shaped value that does not exist never reaches the hub, ``edl._hub``; a repo id needs
the hub reachable, asked once, unless ``HF_HUB_OFFLINE``), the first record of local data
files in the declared format, and ``--reward``'s functions importable (``CommandError``: exit 1).
"""

from __future__ import annotations

import glob
import math
from pathlib import Path
from typing import Literal

import jax

from edl._hub import hub_offline, hub_unreachable, is_repo_id, no_such_path, unreachable_error
from edl.cli.config import CommandError, ConfigError, TrainConfig
from edl.cli.run import check_output_dir
from edl.sharding import mesh_slices

__all__ = ["check_before_work", "check_data", "check_hub", "check_mesh", "check_model_path"]


def check_before_work(config: TrainConfig) -> None:
    """Every check of the module docstring, cheapest first; the first failure raises."""
    check_mesh(config, jax.device_count(), mesh_slices(jax.devices()))
    check_output_dir(config)
    if config.model:
        check_model_path(config.model)
    if config.teacher:
        check_model_path(config.teacher, flag="--teacher")
    if config.data:
        check_data(config.data, _data_format(config), flag="--data")
    if config.eval_data:
        check_data(config.eval_data, _data_format(config), flag="--eval-data")
    if config.method == "grpo":
        from edl.cli.post import environment_factory, reward_functions

        reward_functions(config.reward)  # imported now: a wrong name fails before the model
        environment_factory(config)


def check_mesh(config: TrainConfig, devices: int, present: tuple[int, str] = (1, "")) -> None:
    """``--mesh``'s sizes against the ``devices`` present and its slices (after ``/``)
    against those ``present`` (``edl.sharding.mesh_slices``), ``ConfigError`` naming both;
    and a mesh only for ``--method sft``."""
    spec = config.mesh_spec
    if spec is None:
        return
    if config.method != "sft":
        raise ConfigError(f"--mesh is for --method sft, not {config.method}")
    slices = math.prod(spec.dcn or (1,))
    if spec.dcn is not None and slices != present[0]:
        raise ConfigError(
            f"--mesh {config.mesh} spans {slices} slices, the devices are in {present[0]} "
            f"{present[1]}"
        )
    dims = spec.ici
    asked = math.prod(d for d in dims if d != -1) * slices
    if -1 in dims and devices % asked:
        raise ConfigError(
            f"--mesh {config.mesh} needs a multiple of {asked} devices, {devices} present"
        )
    if -1 not in dims and asked != devices:
        raise ConfigError(
            f"--mesh {config.mesh} asks for {asked} devices, {devices} present "
            "(use -1 for one axis to take the rest)"
        )


def check_model_path(model: str, *, flag: str = "--model") -> None:
    """``--model`` (or ``flag``: ``--teacher``): an existing path, or a hub repo id (looked up
    when the model loads) with the hub reachable (:func:`check_hub`); ``CommandError`` for a
    missing path-shaped value."""
    if is_repo_id(model):
        check_hub(model, "model", flag=flag)
    elif not Path(model).expanduser().exists():
        raise CommandError(f"{flag} {no_such_path(model)}")


def check_hub(repo_id: str, kind: Literal["model", "dataset"], *, flag: str) -> None:
    """Unless ``HF_HUB_OFFLINE``: one request to the hub (``edl._hub.hub_unreachable``), and
    ``CommandError`` at once when it cannot be reached, instead of the hub libraries' minute
    of retries; the message says whether the repo is cached (``HF_HUB_OFFLINE=1`` reads it)."""
    if hub_offline():
        return
    reason = hub_unreachable()
    if reason is not None:
        raise CommandError(f"{flag} {unreachable_error(repo_id, reason, kind)}")


def check_data(spec: str, format: str, *, flag: str) -> None:
    """``spec`` (``--data`` / ``--eval-data``): local files exist and the first record of
    the first file is a ``format`` record (``"prompt"``: a GRPO prompt; ``"unpaired"``: a KTO
    record; ``"distill"``: a distillation record); a hub dataset name
    is read when the data loads. ``CommandError`` naming the flag and the file (and line).
    Only the first file is read (and hashed): a large data set costs nothing here."""
    from edl.text import data_files  # imports the text stack: only when there is data
    from edl.text.sources import resolve_files

    if not (Path(spec).expanduser().exists() or glob.has_magic(spec)):
        name = spec.partition(":")[0]
        if not is_repo_id(name):
            raise CommandError(f"{flag} {no_such_path(spec)}")
        check_hub(name, "dataset", flag=flag)
        return
    try:
        first_file = resolve_files(spec)[:1]
        first = next(iter(data_files(first_file).records()), None)
        if first is not None:
            _check_record(first[1], format, first[0])
    except (OSError, ValueError) as e:
        raise CommandError(f"{flag} {e}") from None


def _data_format(config: TrainConfig) -> str:
    """The format ``--data``'s records must have for ``config.method``."""
    formats = {"sft": config.format, "grpo": "prompt", "kto": "unpaired", "distill": "distill"}
    return formats.get(config.method, "preference")


def _check_record(record: dict[str, object], format: str, where: str) -> None:
    from edl.text.sources import validate, validate_prompt

    if format == "unpaired":
        from edl.train.kto_data import check_unpaired

        check_unpaired(record, where)
    elif format == "distill":
        from edl.train.distill_data import check_distill_record

        check_distill_record(record, where)
    elif format != "prompt":
        validate(record, format, where)
    elif "prompt" not in record:
        raise ValueError(f"{where}: --method grpo reads records with a 'prompt' field")
    else:
        validate_prompt(record["prompt"], where)
