"""``edl export``: a checkpoint or run as a plain Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from edl.cli.config import CommandError
from edl.cli.info import resolve_model
from edl.io.export import export_model
from edl.io.formats.hf import ADAPTER_CONFIG

__all__ = ["run_export"]


def run_export(source: Path, out_dir: Path, *, merge_lora: bool, dtype: str | None) -> None:
    """Export the model behind ``source`` (a run directory's newest whole checkpoint, a
    checkpoint or a saved model) to ``out_dir`` (``edl.io.export.export_model``) and say
    what was written."""
    directory = resolve_model(source)
    try:
        out = export_model(
            directory,
            out_dir,
            merge_lora=merge_lora,
            dtype=None if dtype is None else jnp.dtype(dtype),
        )
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    adapter = out / ADAPTER_CONFIG
    extra = f"; LoRA adapter (PEFT) beside the base: {adapter}" if adapter.is_file() else ""
    print(f"exported {directory} to {out}{extra}")
