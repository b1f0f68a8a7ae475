"""Reading a checkpoint's model arrays into ``like``'s model (``load_state``'s half that
knows the layouts: a Hugging Face-layout model, an adapter-only one, a plain pytree, a
sharded one)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from edl import lora as edl_lora
from edl import tree as edl_tree
from edl.io.checkpoint import adapter_only
from edl.io.checkpoint import sharded as sharded_io
from edl.io.checkpoint.directory import _MODEL
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.manifest import describe
from edl.io.formats.plan import LoadPlan, TensorSource, load_arrays
from edl.io.formats.safetensors import CheckpointReader
from edl.io.model_files import read_model_files

__all__ = ["fill", "read_model", "read_tree", "targets_of"]


def targets_of(tree: PyTree) -> dict[str, Any]:
    return {p: x for p, x in edl_tree.flatten(tree).items() if edl_tree.is_array_like(x)}


def _check_kinds(where: str, stored: Mapping[str, np.dtype], targets: Mapping[str, Any]) -> None:
    bad = [
        f"  {p}: expected {np.dtype(t.dtype)} vs stored {stored[p]}"
        for p, t in targets.items()
        if jnp.issubdtype(stored[p], jnp.inexact) != jnp.issubdtype(t.dtype, jnp.inexact)
    ]
    if bad:
        raise ValueError(
            f"{where}: {len(bad)} tensors cannot be cast between floating and integer "
            "(expected vs actual):\n" + "\n".join(bad)
        )


def read_tree(checkpoint: Path, prefix: str, targets: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Tensors keyed by edl path, checked against ``targets`` before any data is read."""
    with CheckpointReader(checkpoint, prefix=prefix) as reader:
        infos = {k: reader.info(k) for k in reader}
        stored = {k: jax.ShapeDtypeStruct(i.shape, i.dtype) for k, i in infos.items()}
        edl_tree.validate(stored, targets, check_dtype=False).raise_if_invalid(
            f"checkpoint {reader.path}"
        )
        _check_kinds(str(reader.path), {k: i.dtype for k, i in infos.items()}, targets)
        plan = LoadPlan.by_name(TensorSource.from_reader(reader), targets)
        return load_arrays(plan, targets)  # cast to the targets' dtypes


def fill(tree: PyTree, loaded: Mapping[str, Any]) -> PyTree:
    return edl_tree.named_map(
        lambda p, x: loaded[p] if p in loaded and edl_tree.is_array_like(x) else x, tree
    )


def read_model(
    checkpoint: Path, info: dict[str, Any], model: Any, base: BaseReference | None
) -> dict[str, jax.Array]:
    """The model arrays ``checkpoint`` holds for ``model`` (``like``'s), by edl path: all of
    them, or an adapter-only checkpoint's adapters (its base must be ``base``'s)."""
    targets = targets_of(model)
    model_format = info.get("model_format")
    stored = adapter_only.stored_base(info, checkpoint)
    if stored is not None:
        adapter_only.check_same_base(stored, base, checkpoint)
        if model_format == "sharded":  # the adapters' pieces; the base stays like's
            lora = {p: t for p, t in targets.items() if edl_lora.lora_trainable.search(p)}
            return sharded_io.read_pieces(checkpoint, _MODEL, lora)
    if model_format in ("hf", adapter_only.ADAPTER_FORMAT):
        manifest = describe(model)
        if not manifest.registered:
            raise ValueError(
                f"load_state: {checkpoint} holds a Hugging Face-layout model but like's model "
                f"is a {type(model).__name__}, not a registered edl model class"
            )
        if model_format == adapter_only.ADAPTER_FORMAT:
            return adapter_only.read_adapter_only(checkpoint, model, targets, manifest)
        try:
            return read_model_files(checkpoint, model, targets, manifest=manifest)
        except ValueError as e:
            raise ValueError(f"load_state: checkpoint {e}") from None
    if model_format == "tree":
        return read_tree(checkpoint, _MODEL, targets)
    if model_format == "sharded":
        return sharded_io.read_pieces(checkpoint, _MODEL, targets)
    raise ValueError(f"load_state: {checkpoint}: unknown model_format {model_format!r}")
