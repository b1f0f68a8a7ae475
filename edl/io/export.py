"""Models out of checkpoints: ``load_model`` (any edl model directory, LoRA-wrapped and
quantized checkpoints included) and ``export_model`` (a plain Hugging Face directory).

A training checkpoint of a LoRA-wrapped (or quantized, QLoRA) model already holds what
transformers reads (``edl.io.model_files``: the base model, the adapter in PEFT's layout
beside it) plus what only edl reads (the quantized codes, the optimizer state, the layers'
settings in ``state.json``'s ``"layers"``). ``export_model`` writes the model alone::

    OUT_DIR/                        # export_model(checkpoint, OUT_DIR)
      config.json, model*.safetensors, generation_config.json, tokenizer files
                                    # the base model (a quantized base dequantized)
      adapter_config.json, adapter_model.safetensors
                                    # only when the model has LoRA adapters: PEFT's layout
      edl_export.json               # what was exported from where (marks an export)

    AutoModelForCausalLM.from_pretrained(OUT_DIR)   # with peft installed: base + adapter
    peft.PeftModel.from_pretrained(base, OUT_DIR)   # the adapter on a base of your own

With ``merge_lora=True`` the adapters are folded into the weights (after dequantizing a
quantized base) and ``OUT_DIR`` is one plain model, no adapter files.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import json
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from edl import lora as edl_lora
from edl import quantize as edl_quantize
from edl.io.checkpoint.adapter_only import ADAPTER_FORMAT, read_adapters, stored_base
from edl.io.checkpoint.directory import STATE_NAME, check_named_files, read_manifest
from edl.io.checkpoint.sharded import StoredArrays
from edl.io.formats import hf
from edl.io.formats.base_ref import locate, verify
from edl.io.formats.files import UnsafePathError, fsync, inside, read_json, write_json_atomic
from edl.io.formats.hf import ADAPTER_CONFIG
from edl.io.formats.manifest import Manifest, describe, rebuild
from edl.io.formats.peft import ADAPTER_WEIGHTS, load_adapter
from edl.io.formats.safetensors import LazyTensor, save_tensors
from edl.io.model_files import read_model_files, write_model_files
from edl.module import require_float_dtype
from edl.nn import LoraLinear
from edl.tree import find, flatten, is_array_like, named_map

__all__ = ["EXPORT_MARKER", "TOKENIZER_FILES", "export_model", "load_base", "load_model"]

EXPORT_MARKER = "edl_export.json"
"""The file that marks a directory as an ``export_model`` output (which may be replaced)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
"""Tokenizer files copied from a model directory whose ``state.json`` does not list them."""


def _checkpoint_info(directory: Path) -> dict[str, Any] | None:
    """``directory``'s ``state.json``, its file names checked to stay inside it
    (``check_named_files``), or ``None`` when it has none."""
    file = directory / STATE_NAME
    if not file.is_file():
        return None
    info = read_json(file, what="checkpoint state")
    check_named_files(directory, info)
    return info


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: DTypeLike | None = None,
    base: str | os.PathLike[str] | None = None,
) -> eqx.Module:
    """The model in an edl model directory: a training checkpoint (LoRA-wrapped and
    quantized models rebuilt from ``state.json``'s manifest, exactly as trained), a
    Hugging Face model directory with an embedded PEFT adapter (the base with the adapter
    applied, as transformers does with peft installed), or a plain Hugging Face model
    directory / hub repo id (``edl.io.formats.hf.from_pretrained``). ``dtype`` casts
    floating weights (quantization codes and scales keep theirs). A checkpoint written
    before manifests is read by its ``config.json`` and ``"layers"``
    (``edl.io.checkpoint.directory.read_manifest``).

    An adapter-only checkpoint (``edl.io.checkpoint.adapter_only``) holds the adapters and
    a reference to its base: the base is found by the reference, or at ``base`` (a directory
    or hub repo id holding the same weights elsewhere), refused when its weights hash
    differently (``edl.io.formats.base_ref``), built as the run built it
    (:func:`load_base`), and the adapters are put on it."""
    directory = Path(path)
    info = _checkpoint_info(directory) if directory.is_dir() else None
    if info is not None and info.get("model_format") == ADAPTER_FORMAT:
        return _load_adapter_only(directory, info, dtype=dtype, base=base)
    if info is not None and info.get("model_format") == "sharded":
        raise ValueError(
            f"load_model: {directory} is a sharded checkpoint (one file set per "
            f"process): edl export streams it into a Hugging Face directory, "
            f"edl.io.checkpoint.load_state reads it onto a mesh"
        )
    manifest = None if info is None else read_manifest(directory, info)
    if manifest is None or not manifest.layer_structure:
        model = hf.from_pretrained(path, dtype=dtype)
        if directory.is_dir() and (directory / ADAPTER_CONFIG).is_file():
            model = load_adapter(model, directory, dtype=dtype)
        return model
    if info.get("model_format") != "hf":
        raise ValueError(
            f"load_model: {directory} holds no Hugging Face-layout model "
            f"(model_format {info.get('model_format')!r})"
        )
    abstract = rebuild(manifest, where=f"load_model: {directory / STATE_NAME} 'layers'")
    targets = _targets(abstract, dtype)
    try:
        loaded = read_model_files(directory, abstract, targets, manifest=manifest)
    except ValueError as e:
        raise ValueError(f"load_model: {e}") from None
    model = named_map(lambda p, x: loaded.get(p, x), abstract)
    generation = hf.load_generation_config(directory)
    if generation and hasattr(model, "generation_config"):
        model = dataclasses.replace(model, generation_config=generation)
    return model


def load_base(
    source: str | os.PathLike[str],
    *,
    dtype: DTypeLike | None = None,
    quantization: Mapping[str, Any] | None = None,
) -> eqx.Module:
    """The base model a LoRA / QLoRA run trains adapters on, from ``source`` (any
    :func:`load_model` source): loaded in ``dtype``, an earlier run's LoRA adapters merged
    into it, then, unless it is quantized already, quantized with ``quantization``
    (``edl.quantize.QuantConfig``'s fields; ``None``: not). ``edl train --model`` builds its
    base so, and an adapter-only checkpoint's base is built again so, identically."""
    model = load_model(source, dtype=dtype)
    if find(model, lambda x: isinstance(x, LoraLinear)):
        model = edl_lora.merge_lora(model)
    if quantization is not None and not edl_quantize.is_quantized(model):
        try:
            config = edl_quantize.QuantConfig(**quantization)
        except (TypeError, ValueError) as e:
            raise ValueError(f"load_base: quantization {dict(quantization)!r}: {e}") from None
        model = edl_quantize.quantize(model, config)
    return model


def _load_adapter_only(
    directory: Path,
    info: dict[str, Any],
    *,
    dtype: DTypeLike | None,
    base: str | os.PathLike[str] | None,
) -> eqx.Module:
    """The model of an adapter-only checkpoint: its base found (``base``, else the stored
    reference), verified and built by :func:`load_base`, its adapters read on top."""
    ref = stored_base(info, directory)
    assert ref is not None  # an adapter-only checkpoint's state.json has one
    found = locate(ref, directory, base=base)
    verify(ref, found, directory)
    base_model = load_base(found, dtype=ref.dtype, quantization=ref.quantization)
    manifest = read_manifest(directory, info)
    abstract = rebuild(manifest, where=f"load_model: {directory / STATE_NAME} 'manifest'")
    targets = _targets(abstract, dtype)
    adapters = read_adapters(directory, abstract, targets, manifest=manifest)
    base_arrays = {p: x for p, x in flatten(base_model).items() if is_array_like(x)}

    def pick(path: str, x: Any) -> Any:
        if not is_array_like(x) or path in adapters:
            return adapters.get(path, x)
        key = path.replace(".base_layer.", ".")
        found = base_arrays.pop(key, None)
        if found is None or found.shape != x.shape:
            what = "none" if found is None else f"shape {found.shape}"
            raise ValueError(
                f"load_model: {directory / STATE_NAME}: the base model has {what} at {key}, "
                f"the checkpoint's model needs shape {x.shape}"
            )
        return found.astype(targets[path].dtype)

    model = named_map(pick, abstract)
    if hasattr(base_model, "generation_config"):
        model = dataclasses.replace(model, generation_config=base_model.generation_config)
    return model


def _targets(abstract: eqx.Module, dtype: DTypeLike | None) -> dict[str, Any]:
    """``abstract``'s arrays by path, floating ones cast to ``dtype`` (quantization scales
    keep theirs)."""
    targets = {p: x for p, x in flatten(abstract).items() if is_array_like(x)}
    if dtype is None:
        return targets
    require_float_dtype(dtype, "load_model: dtype")
    return {
        p: jax.ShapeDtypeStruct(x.shape, dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) and not p.endswith(".scales")
        else x
        for p, x in targets.items()
    }


def _own_file(directory: Path, name: str) -> Path:
    """``directory / name``, refused when it is a symlink that leads out of ``directory``:
    what export copies lands in a directory users publish, so a checkpoint's
    ``tokenizer.json`` linked to ``~/.cache/huggingface/token`` must not be copied."""
    path = directory / name
    real, root = path.resolve(), directory.resolve()
    # A hub cache snapshot (``models--org--name/snapshots/<rev>``) links each file to the
    # repo's own ``blobs/``: those stay inside the downloaded repo.
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if root not in real.parents and (blobs is None or real.parent != blobs):
        raise UnsafePathError(
            f"export: {path} is a symlink to {real}, outside {directory}; export copies only "
            "files inside the model directory (copy the file in instead of linking it)"
        )
    return path


def _tokenizer_files(source: Path, info: dict[str, Any] | None) -> dict[str, Path]:
    """The tokenizer files export copies, by their names in the export: ``state.json``'s
    ``"tokenizer_files"`` (each inside ``source``, and present), else those of
    :data:`TOKENIZER_FILES` that ``source`` holds (none may be a symlink leading out)."""
    names = info.get("tokenizer_files") if info else None
    if names is None:
        return {n: _own_file(source, n) for n in TOKENIZER_FILES if (source / n).is_file()}
    state = source / STATE_NAME
    files = {}
    for i, name in enumerate(names):
        file = inside(source, name, source=state, entry=f"tokenizer_files[{i}]")
        if not file.is_file():
            raise FileNotFoundError(
                f"export: {state}: tokenizer_files[{i}] = {name!r} is not a file in {source}"
            )
        files[name] = file
    return files


def _destination(out: Path) -> Path:
    """The directory the export replaces: ``out``, or the directory a symlink ``out`` points
    to (replaced where it is, so the link keeps pointing at a whole export). It must be new,
    empty or an earlier export; a link must point at an existing directory."""
    target = out.resolve() if out.is_symlink() else out
    what = f"{out} (a symlink to {target})" if out.is_symlink() else str(out)
    if out.is_symlink() and not target.exists():
        raise FileNotFoundError(
            f"export: {what} does not exist; point the link at a directory, or remove it"
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"export: {what} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (target / EXPORT_MARKER).is_file():
        raise FileExistsError(
            f"export: {what} is not empty and holds no earlier export ({EXPORT_MARKER}); "
            "choose an empty or new directory"
        )
    return target


def _write_export(
    model: eqx.Module, tmp: Path, out: Path, *, merge_lora: bool, dtype: DTypeLike | None
) -> bool:
    """The model's files in ``tmp`` (to become ``out``); returns whether an adapter was
    written beside the base."""
    manifest = describe(model)
    dense = edl_quantize.dequantize(model) if manifest.quantized_layers else model
    manifest = manifest.without("quantized")
    if manifest.lora_targets and merge_lora:
        dense, manifest = edl_lora.merge_lora(dense), manifest.without("lora")
    out_name = str(out.resolve())
    parts = write_model_files(
        dense, tmp, dtype=dtype, base_model_name_or_path=out_name, manifest=manifest
    )
    return ADAPTER_WEIGHTS in parts


def _write_sharded_export(
    source: Path, manifest: Manifest, tmp: Path, *, dtype: DTypeLike | None
) -> bool:
    """A sharded checkpoint's model (``manifest``: its ``read_manifest``) as HF files in
    ``tmp``, one tensor at a time (a stacked array one layer at a time), read from the
    processes' pieces: the whole model is never in memory. Plain registered models only
    (LoRA / quantized layers: resume the run in one process and export its checkpoint).
    Returns False (no adapter)."""
    if manifest.layer_structure:
        raise ValueError(
            f"export: {source} is a sharded checkpoint of a model with LoRA or "
            f"quantized layers, which export does not stream yet; resume the "
            f"run in one process and export its checkpoint"
        )
    if not manifest.registered:
        raise ValueError(
            f"export: {source} is a sharded checkpoint of a {manifest.model_class or 'pytree'} "
            "that no registered family builds: export writes Hugging Face files"
        )
    table = manifest.key_table()
    with StoredArrays(source, "model") as stored:
        tensors = {}
        for path, entry in stored.arrays.items():
            shape, depth = entry.shape, table.stack_depth(path)
            stored_dtype = entry.dtype
            cast = dtype is not None and jnp.issubdtype(stored_dtype, jnp.floating)
            want = np.dtype(dtype) if cast else stored_dtype

            def load(
                index: tuple[int, ...],
                path: str = path,
                shape: tuple = shape,
                want: np.dtype = want,
            ) -> np.ndarray:
                rest = shape[len(index) :]
                block = stored.block(path, (*index, *(0,) * len(rest)), (*(1,) * len(index), *rest))
                stored.done()  # one block in memory at a time
                return block.reshape(rest).astype(want, copy=False)

            for index in np.ndindex(*shape[:depth]):
                index = tuple(int(i) for i in index)
                tensors[table.to_hf(path, index or None)] = LazyTensor(
                    shape[depth:], want, lambda index=index, load=load: load(index)
                )
        save_tensors(tensors, tmp, metadata={"format": "pt"})
    floats = {t.dtype.name for t in tensors.values() if jnp.issubdtype(t.dtype, jnp.floating)}
    hf.write_config(manifest, tmp, floats.pop() if len(floats) == 1 else None)
    if (source / hf.GENERATION_CONFIG_NAME).is_file():
        shutil.copy2(_own_file(source, hf.GENERATION_CONFIG_NAME), tmp / hf.GENERATION_CONFIG_NAME)
    return False


def export_model(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    merge_lora: bool = False,
    dtype: DTypeLike | None = None,
) -> Path:
    """Write the model of ``source`` (a checkpoint or model directory, see
    :func:`load_model`) to ``out_dir`` as a plain Hugging Face model directory (weights,
    ``config.json``, ``generation_config.json``, the tokenizer files of ``source``), and its
    LoRA adapters, if any, either merged (``merge_lora``) or in PEFT's layout beside the
    base (``adapter_config.json``, ``adapter_model.safetensors``). A quantized base is
    dequantized (transformers cannot read edl's codes). ``dtype`` casts floating weights.

    ``out_dir`` must be new, empty, or an earlier export (``edl_export.json``), which is
    replaced; the export is written into a temporary sibling and swapped into place, so
    ``out_dir`` is at every instant the earlier export or the complete new one (where the OS
    swaps two directories in one step, Linux; elsewhere it is absent for an instant). A
    symlink ``out_dir`` to such a directory keeps pointing at it, and it is that directory
    which is replaced; a link to anything else (a file, another non-empty directory,
    nothing) is refused.

    Every file read from ``source``'s own metadata (``state.json``'s ``tokenizer_files``,
    ``model_files``, ...; a weight index's ``weight_map``) must stay inside ``source`` after
    resolving symlinks, and the files copied into the export (tokenizer files,
    ``generation_config.json``) must not be symlinks leading out of it: anything else is
    refused (``UnsafePathError``, a ``ValueError``, naming the file and the entry) before
    anything is written. A Hugging Face cache snapshot (``.../snapshots/<revision>``, its
    files links into the repo's ``blobs/``) is exported as it is.
    """
    if dtype is not None:
        require_float_dtype(dtype, "export_model: dtype")
    source, out = Path(source), Path(out_dir)
    target = _destination(out)
    info = _checkpoint_info(source) if source.is_dir() else None
    tokenizer_files = _tokenizer_files(source, info) if source.is_dir() else {}
    if (source / hf.GENERATION_CONFIG_NAME).is_file():  # its values go into the export
        _own_file(source, hf.GENERATION_CONFIG_NAME)
    sharded = info is not None and info.get("model_format") == "sharded"
    model = None if sharded else load_model(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-export-{target.name}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        if sharded:
            manifest = read_manifest(source, info)
            adapter = _write_sharded_export(source, manifest, tmp, dtype=dtype)
        else:
            adapter = _write_export(model, tmp, target, merge_lora=merge_lora, dtype=dtype)
        _copy_tokenizer_files(tokenizer_files, tmp, source)
        marker = {
            "source": str(source.resolve()),
            "step": info and info.get("step"),
            "merge_lora": merge_lora,
            "adapter": adapter,
            "dtype": None if dtype is None else jnp.dtype(dtype).name,
        }
        write_json_atomic(tmp / EXPORT_MARKER, json.loads(json.dumps(marker)))
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync(file)
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_tokenizer_files(files: dict[str, Path], tmp: Path, source: Path) -> None:
    """Copy ``files`` (name in the export -> file) into ``tmp``, which holds the model's
    files already: a name that would replace one of those is refused."""
    for name, file in files.items():
        if (tmp / name).exists():
            raise ValueError(
                f"export: {source / STATE_NAME}: tokenizer_files names {name!r}, a file "
                "the export writes itself"
            )
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, tmp / name)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


@functools.cache
def _renameat2() -> Any:
    """glibc's ``renameat2`` (Linux), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is not None:
        path, fd = ctypes.c_char_p, ctypes.c_int
        function.argtypes = [fd, path, fd, path, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one step (``RENAME_EXCHANGE``), so that
    ``b`` is never absent; ``False`` where the OS or the file system cannot (Python's
    ``os`` has no such call)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), os.fspath(a), None, os.fspath(b))


def _replace(new: Path, out: Path) -> None:
    """``new`` moved to ``out``: swapped with an earlier ``out`` in one step where the OS can
    (the earlier one then deleted), else the earlier ``out`` renamed aside first, then
    deleted."""
    if out.exists() and _exchange(new, out):
        fsync(out.parent)
        shutil.rmtree(new, ignore_errors=True)  # the earlier export, now
        return
    old = None
    if out.exists():
        old = out.with_name(f".old-export-{out.name}-{uuid.uuid4().hex[:12]}")
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    fsync(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
