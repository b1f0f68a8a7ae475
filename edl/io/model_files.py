"""A registered model's Hugging Face files, LoRA adapters and quantized layers included:
``write_model_files`` / ``read_model_files``, the model half of a training checkpoint and of
``edl.io.export``.

A plain model is ``save_pretrained``'s directory. A model with LoRA adapters or quantized
layers is written so that transformers loads it as it is::

    config.json, model*.safetensors      # the base model under plain HF names (a quantized
                                         # layer dequantized): AutoModelForCausalLM reads it
    adapter_config.json,                 # the LoRA adapters in PEFT's layout, beside the base:
    adapter_model.safetensors            # transformers' "embedded adapter", applied by
                                         # AutoModelForCausalLM when peft is installed
    quantized*.safetensors               # the quantized layers' codes and scales, exactly

so ``AutoModelForCausalLM.from_pretrained(directory)`` (with peft) is the fine-tuned model,
and ``peft.PeftModel.from_pretrained(base, directory)`` reads the adapter alone. edl reads
the codes back, not the dequantized copy, so a QLoRA checkpoint resumes bit for bit; what
the base layers were (rank, scaling, format, ...) is ``edl.io.formats.structure``'s record, which
``save_state`` keeps in ``state.json``. Older checkpoints, whose ``model.safetensors`` holds
the wrapped names (``q_proj.base_layer.weight``, ``q_proj.lora_A.weight``), still read.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jax.typing import DTypeLike

from edl import lora as edl_lora
from edl import quantize as edl_quantize
from edl.io.formats import hf
from edl.io.formats.manifest import Manifest, describe
from edl.io.formats.peft import ADAPTER_WEIGHTS, PEFT_PREFIX, save_adapter
from edl.io.formats.plan import TensorSource, load_arrays, plan_load
from edl.io.formats.safetensors import CheckpointReader, save_tensors
from edl.models.keymap import KeyTable
from edl.tree import named_map

__all__ = ["MODEL", "QUANTIZED", "read_model_files", "write_model_files"]

MODEL = "model"
"""The base model's safetensors prefix (``model.safetensors`` or its shards)."""
QUANTIZED = "quantized"
"""The quantized layers' codes and scales (``quantized.safetensors``), edl's own file."""
_CODES = re.compile(r"\.(qweight|scales)$")  # a QuantizedLinear's arrays (its bias is dense)
_BASE = ".base_layer"


def write_model_files(
    model: eqx.Module,
    directory: str | os.PathLike[str],
    *,
    dtype: DTypeLike | None = None,
    base_model_name_or_path: str | None = None,
    manifest: Manifest | None = None,
) -> list[str]:
    """Write ``model`` (a registered edl model class) into ``directory`` as described above;
    return the safetensors prefixes written (``"model"``, ``"adapter_model"``,
    ``"quantized"``). ``dtype`` casts the floating weights and adapters (never the codes
    and scales). ``base_model_name_or_path`` goes in ``adapter_config.json``: transformers
    before the embedded-adapter rule loads the base from there, so point it at where
    ``directory`` will be. ``manifest``: ``model``'s (``describe(model)`` when not given)."""
    expert_lora = sorted(edl_lora.lora_experts(model))
    if expert_lora:  # their keys are PEFT's nested ones, which this layout does not read back
        raise ValueError(
            f"{directory}: LoRA on expert weights ({expert_lora}) is not in edl's model files "
            f"yet: save the adapters with edl.io.formats.peft.save_adapter"
        )
    manifest = manifest or describe(model)
    has_lora, quantized = bool(manifest.lora_targets), bool(manifest.quantized_layers)
    dense = edl_quantize.dequantize(model) if quantized else model
    dense_manifest = manifest.without("quantized")
    base, base_manifest = dense, dense_manifest
    if has_lora:
        base, base_manifest = edl_lora.unwrap_lora(dense), dense_manifest.without("lora")
    hf.save_pretrained(base, directory, dtype=dtype, manifest=base_manifest)
    parts = [MODEL]
    if has_lora:
        save_adapter(
            dense,
            directory,
            base_model_name_or_path=base_model_name_or_path,
            dtype=dtype,
            manifest=dense_manifest,
        )
        parts.append(ADAPTER_WEIGHTS)
    if quantized:
        codes_only = named_map(lambda p, x: x if _CODES.search(p) else None, model)
        codes = hf.export_state_dict(codes_only, manifest=manifest)
        save_tensors(codes, directory, prefix=QUANTIZED, metadata={"format": "edl"})
        parts.append(QUANTIZED)
    return parts


def _has_part(directory: Path, prefix: str) -> bool:
    return any(
        (directory / f"{prefix}{s}").is_file() for s in (".safetensors", ".safetensors.index.json")
    )


def _base_names(keys: list[str], expected: set[str]) -> dict[str, str]:
    """The model file's keys by the names the wrapped model reads them under: a LoRA layer's
    base weights (``q_proj.weight``) as ``q_proj.base_layer.weight``; the dequantized copy
    of a quantized layer's weight is passed over (its codes are read instead)."""
    names = {}
    for key in keys:
        module, _, leaf = key.rpartition(".")
        wrapped = f"{module}{_BASE}.{leaf}"
        codes = {f"{module}.qweight", f"{module}{_BASE}.qweight"}
        if key in expected:
            names[key] = key
        elif wrapped in expected:
            names[wrapped] = key
        elif not (leaf == "weight" and codes & expected):  # else: the dequantized copy
            names[key] = key  # plan_load reports it as unexpected
    return names


def _expected_names(
    table: KeyTable, targets: Mapping[str, jax.Array | jax.ShapeDtypeStruct]
) -> set[str]:
    return {
        table.to_hf(p, tuple(int(i) for i in index) or None)
        for p, t in targets.items()
        for index in np.ndindex(*t.shape[: table.stack_depth(p)])
    }


def read_model_files(
    directory: str | os.PathLike[str],
    model: eqx.Module,
    targets: Mapping[str, jax.Array | jax.ShapeDtypeStruct],
    *,
    manifest: Manifest | None = None,
) -> dict[str, jax.Array]:
    """The arrays of ``model`` (a registered edl model class, possibly LoRA-wrapped and
    quantized; abstract is fine) from the files :func:`write_model_files` wrote, keyed by
    edl path. ``targets`` (edl path -> array-like) gives each array's dtype and placement
    (``edl.io.formats.plan.load_arrays``). Every tensor is checked against the model before
    any is read: one ``ValueError`` names the directory and every missing, unexpected,
    duplicated or mis-shaped key. ``manifest``: ``model``'s (``describe(model)`` when not
    given)."""
    directory = Path(directory)
    table = (manifest or describe(model)).key_table()
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected = _expected_names(table, targets)
    abstract = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in targets.items()}
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(CheckpointReader(directory, prefix=MODEL))
        sources = [(base.path, TensorSource.from_reader(base, _base_names(list(base), expected)))]
        for prefix, strip in ((ADAPTER_WEIGHTS, PEFT_PREFIX), (QUANTIZED, "")):
            if _has_part(directory, prefix):
                reader = stack.enter_context(CheckpointReader(directory, prefix=prefix))
                names = {k.removeprefix(strip): k for k in reader}
                sources.append((reader.path, TensorSource.from_reader(reader, names)))
        source = _union(sources)
        try:
            plan = plan_load(table, abstract, source, tie_word_embeddings=tied)
        except ValueError as e:
            raise ValueError(f"{directory}: {e}") from None
        return load_arrays(plan, targets)


def _union(sources: list[tuple[Path, TensorSource]]) -> TensorSource:
    """One source of all; a name two files both hold raises, naming them."""
    owner: dict[str, Path] = {}
    for path, source in sources:
        for name in source.tensors:
            if name in owner:
                raise ValueError(f"{name} is in both {owner[name]} and {path}")
            owner[name] = path
    out = sources[0][1]
    for _, source in sources[1:]:
        out = out | source
    return out
