"""Adapter-only checkpoints of LoRA / QLoRA runs: the adapters, not the base they adapt.

``save_state(state, directory, base=ref)`` with ``ref`` an
``edl.io.formats.base_ref.BaseReference`` (where the base model was loaded from and the
sha256 of its weights) writes, for a LoRA-wrapped model::

    checkpoint-00000100/
      adapter_config.json            # PEFT's; base_model_name_or_path = ref.source, so
      adapter_model.safetensors      # transformers + peft load base + adapter from here
      optimizer.safetensors, tokenizer files
      state.json                     # "model_format": "adapter", "base": ref.to_json()

no copy of the base: a 135M-parameter base is 538 MB, its rank-8 adapters 9 MB. A QLoRA
run's quantized codes are not saved either: ``ref.quantization`` says how they were made
from the base, and they are made again on load (deterministic). A multi-process (sharded)
save writes the adapters' pieces alone, with the same ``"base"``.

Loading needs the base. ``load_state(checkpoint, like, base=ref)`` takes it from ``like``
(a state built from that base, as the run that resumes builds it): ``ref``, computed when the
base was loaded, must hash as the stored reference does, else the load is refused naming
both hashes and the checkpoint's ``state.json``; only the adapters (and the optimizer state)
are read. ``edl.io.export.load_model(checkpoint)`` finds the base by the stored reference
(``edl.io.formats.base_ref.locate``), verifies its hash and builds the model alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from edl import lora as edl_lora
from edl import tree as edl_tree
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.manifest import Manifest, describe
from edl.io.formats.peft import ADAPTER_WEIGHTS, PEFT_PREFIX, save_adapter
from edl.io.formats.plan import TensorSource, load_arrays, plan_load
from edl.io.formats.safetensors import CheckpointReader
from edl.state import TrainState

__all__ = [
    "ADAPTER_FORMAT",
    "check_same_base",
    "check_trained",
    "read_adapter_only",
    "read_adapters",
    "stored_base",
    "write_adapters",
]

ADAPTER_FORMAT = "adapter"
"""``state.json``'s ``"model_format"`` of an adapter-only checkpoint."""


def check_trained(state: TrainState, manifest: Manifest) -> None:
    """Refuse an adapter-only save of a state that trains more than LoRA adapters (a new
    head, unfrozen embeddings): those arrays are in no base, so the checkpoint would lose
    them. ``ValueError`` naming the first such array."""
    if not manifest.lora_targets:
        raise ValueError(
            "save_state: base= saves LoRA adapters only, but the model has no LoRA layers; "
            "save without base="
        )
    for path, leaf in edl_tree.flatten(state.params).items():
        if edl_tree.is_array_like(leaf) and not edl_lora.lora_trainable.search(path):
            raise ValueError(
                f"save_state: base= saves LoRA adapters only, but params.{path} is trained "
                "too and is in no base model; save without base= (the full layout)"
            )


def write_adapters(
    tmp: Path, model: PyTree, manifest: Manifest, base: BaseReference, dtype: Any
) -> list[str]:
    """The adapters in PEFT's layout in ``tmp``, pointing PEFT at ``base``; returns the
    safetensors prefixes written (``state.json``'s ``"model_files"``)."""
    save_adapter(
        model,
        tmp,
        base_model_name_or_path=base.source,
        revision=base.revision,
        dtype=dtype,
        manifest=manifest,
    )
    return [ADAPTER_WEIGHTS]


def read_adapters(
    directory: str | os.PathLike[str],
    model: eqx.Module,
    targets: Mapping[str, jax.Array | jax.ShapeDtypeStruct],
    *,
    manifest: Manifest | None = None,
) -> dict[str, jax.Array]:
    """The LoRA A/B arrays of ``model`` (LoRA-wrapped, abstract is fine) from the PEFT
    adapter file in ``directory`` (``adapter_model.safetensors``), keyed by edl path: those
    of ``targets`` that ``edl.lora.lora_trainable`` matches, each checked and cast as
    :func:`read_model_files` does. An adapter-only checkpoint's base comes from elsewhere
    (``edl.io.formats.base_ref``); this reads what the checkpoint itself holds."""
    directory = Path(directory)
    table = (manifest or describe(model)).key_table()
    wanted = {p: t for p, t in targets.items() if edl_lora.lora_trainable.search(p)}
    abstract = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in wanted.items()}
    with CheckpointReader(directory, prefix=ADAPTER_WEIGHTS) as reader:
        source = TensorSource.from_reader(reader, {k.removeprefix(PEFT_PREFIX): k for k in reader})
        try:
            plan = plan_load(table, abstract, source)
        except ValueError as e:
            raise ValueError(f"{reader.path}: {e}") from None
        return load_arrays(plan, wanted)


def stored_base(info: Mapping[str, Any], checkpoint: Path) -> BaseReference | None:
    """The base reference ``state.json`` (``info``) holds, checked; ``None`` for a
    checkpoint with its base inside."""
    if "base" not in info:
        return None
    return BaseReference.from_json(info["base"], where=str(checkpoint / "state.json"))


def check_same_base(stored: BaseReference, base: BaseReference | None, checkpoint: Path) -> None:
    """Refuse to resume ``checkpoint`` (trained on ``stored``) from a state built from
    ``base``: no ``base`` given, other weights (sha256), or another quantization."""
    state = checkpoint / "state.json"
    if base is None:
        raise ValueError(
            f"load_state: {state} holds LoRA adapters only, trained on base model "
            f"{stored.describe()} (sha256 {stored.sha256}); build like from that base and pass "
            "base=edl.io.formats.base_ref.reference(...) of it (edl.io.export.load_model "
            "loads the model alone)"
        )
    if base.sha256 != stored.sha256:
        raise ValueError(
            f"load_state: {state} was trained on base model {stored.describe()} with weights "
            f"sha256 {stored.sha256}, but the base given (like's) is {base.describe()} with "
            f"sha256 {base.sha256}; refusing a different base"
        )
    if dict(base.quantization or {}) != dict(stored.quantization or {}):
        raise ValueError(
            f"load_state: {state} was trained on base model {stored.describe()} quantized "
            f"as {stored.quantization}, but like's base is quantized as {base.quantization}"
        )


def read_adapter_only(
    checkpoint: Path,
    model: PyTree,
    targets: Mapping[str, Any],
    manifest: Manifest,
) -> dict[str, jax.Array]:
    """The adapters of ``checkpoint`` for ``model`` (``like``'s model, its base arrays
    concrete: they are kept, not read); ``ValueError`` when a base array is abstract."""
    for path, x in targets.items():
        if isinstance(x, jax.ShapeDtypeStruct) and not edl_lora.lora_trainable.search(path):
            raise ValueError(
                f"load_state: {checkpoint} holds LoRA adapters only, and like's {path} is "
                "abstract; build like from the base model (its arrays are the base's), or "
                "load the model alone with edl.io.export.load_model"
            )
    return read_adapters(checkpoint, model, targets, manifest=manifest)
