"""Training checkpoints: ``save_state`` / ``load_state`` / ``latest_checkpoint``.

One directory per step, written atomically::

    directory/
      checkpoint-00000100/
        config.json + model*.safetensors  # registered HF families: HF layout, so
                                          # edl.from_pretrained / transformers load it as is
        adapter_config.json + adapter_model.safetensors, quantized.safetensors
                                          # LoRA adapters (PEFT's layout) and quantized
                                          # codes beside the base (edl.io.model_files)
        adapter_config.json + adapter_model.safetensors
                                          # save_state(..., base=ref): a LoRA model's
                                          # adapters alone, no base (edl.io.checkpoint
                                          # .adapter_only; state.json's "base" points at it)
        model*.safetensors                # any other pytree: arrays keyed by edl.tree paths
        optimizer*.safetensors            # opt_state arrays keyed by edl.tree paths
        state.json                        # step, versions, user metadata; written last
      .tmp-checkpoint-00000200-<hex>/     # a save in progress, or one that was killed

A save writes everything into a ``.tmp-checkpoint-*`` sibling (each file fsync'd, then
``state.json``), renames it to ``checkpoint-{step:08d}`` and prunes old checkpoints. A
checkpoint counts as complete only if its ``state.json`` parses (and, sharded, its
``shards.json`` and every process's piece files exist), so a killed writer never shadows the
previous good checkpoint; its leftovers are deleted by the next save. Re-saving a
step first renames the old ``checkpoint-N`` to ``checkpoint-N.old``, which still counts as
step N's checkpoint until the new one is in place, so at every instant a complete checkpoint
exists. ``edl.io.checkpoint.directory.verify_checkpoint`` checks a checkpoint's files
without loading them (a truncated or missing tensor file fails there). Everything is
safetensors and JSON (no pickle).

With several processes (``jax.distributed``), or ``sharded=True``, the model and optimizer
arrays are written as the pieces each process holds (``edl.io.checkpoint.sharded``: one file set per
process and ``shards.json``), nothing gathered to one host. Every process calls
``save_state`` with the same state and directory, on a filesystem they share; the
temporary directory's name comes from process 0, and only after every process has
written and fsync'd its pieces (a barrier) does process 0 write ``state.json`` and rename
the directory, so a kill of any process during a save leaves the previous checkpoint the
newest complete one. ``load_state`` reads such a checkpoint onto any mesh and any number
of processes, each process reading only the blocks its devices hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl import lora as edl_lora
from edl import state as edl_state
from edl import tree as edl_tree
from edl.io.checkpoint import adapter_only, tensors
from edl.io.checkpoint import sharded as sharded_io
from edl.io.checkpoint.directory import (
    _MODEL,
    _OPTIMIZER,
    _TMP,
    STATE_NAME,
    _prune,
    _read_info,
    _replace_atomically,
    check_named_files,
    latest_checkpoint,
)
from edl.io.formats import hf
from edl.io.formats.base_ref import BaseReference
from edl.io.formats.files import fsync, read_json, write_json_atomic
from edl.io.formats.manifest import Manifest, describe
from edl.io.formats.plan import LoadPlan, TensorSource, load_arrays
from edl.io.formats.safetensors import CheckpointReader, save_tensors
from edl.io.model_files import read_model_files, write_model_files
from edl.module import require_float_dtype
from edl.sharding import broadcast_text, sync_processes
from edl.state import TrainState
from edl.text.tokenizer import Tokenizer

__all__ = ["FORMAT", "load_state", "save_state"]

logger = logging.getLogger("edl")

FORMAT = 1
"""Version of the checkpoint layout, stored as ``state.json``'s ``"format"``."""

# -- saving --------------------------------------------------------------------------------


def save_state(
    state: TrainState,
    directory: str | os.PathLike[str],
    *,
    save_optimizer: bool = True,
    float_dtype: DTypeLike | None = None,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = 3,
    tokenizer: Tokenizer | None = None,
    sharded: bool | None = None,
    base: BaseReference | None = None,
) -> Path:
    """Write ``state`` to ``directory/checkpoint-{step:08d}`` atomically and return that path.

    Args:
        state: the training state; its model is ``edl.state.model(state)``.
        directory: the parent of the ``checkpoint-*`` directories (created if needed).
        save_optimizer: also write ``state.opt_state`` (never cast).
        float_dtype: cast floating model weights to this dtype on the way out (e.g.
            ``jnp.bfloat16``); ``None`` stores them exactly.
        metadata: JSON-serialisable data returned by :func:`load_state` (data-iterator
            position, RNG key data, ...); numpy/jax arrays are stored as nested lists.
        keep: how many complete checkpoints to keep, newest first (the one just written always
            stays); ``None`` keeps all.
        tokenizer: its files (``edl.text.HFTokenizer.save``; none for the byte tokenizer)
            are written into the checkpoint with the rest, so a checkpoint never lacks them.
        sharded: write every array as the pieces the processes hold (module docstring)
            instead of whole tensors (HF layout for registered families); ``None``: when
            ``jax.process_count() > 1``, where whole tensors would need a gather.
        base: for a LoRA-wrapped model trained from a base model on disk or on the hub,
            the reference to that base (``edl.io.formats.base_ref.reference(source)``,
            computed once when the base is loaded): the checkpoint then holds the adapters
            alone, in PEFT's layout, and ``state.json``'s ``"base"`` points at the base
            (``edl.io.checkpoint.adapter_only``). Every array of ``state.params`` must be a
            LoRA matrix. ``None``: the whole model is saved (the full layout).

    ``state.json`` records the tokenizer's file names (``"tokenizer_files"``) and the
    model's manifest (``"manifest"``, ``edl.io.formats.manifest``: family, task,
    architecture, config and, for a model with LoRA adapters or quantized layers, their
    settings, which ``"layers"`` also holds for older readers), so the checkpoint can be
    loaded and exported without the code that built the model (``edl.io.export``).

    Re-saving a step replaces the old checkpoint of that step. After the save, incomplete
    ``checkpoint-*`` directories and ``.tmp-checkpoint-*`` leftovers of killed writers are
    deleted.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"save_state: keep must be >= 1 or None, got {keep}")
    if float_dtype is not None:
        require_float_dtype(float_dtype, "save_state: float_dtype")
    step = int(state.step)
    if step < 0:
        raise ValueError(f"save_state: step must be non-negative, got {step}")
    try:
        meta_text = json.dumps(dict(metadata or {}), default=tensors.json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_state: metadata is not JSON-serialisable: {e}") from e

    processes = jax.process_count()
    sharded = processes > 1 if sharded is None else sharded
    if processes > 1 and not sharded:
        raise ValueError(f"save_state: sharded=False needs one process; {processes} run")
    root = Path(directory)
    final = root / f"checkpoint-{step:08d}"
    if base is not None:
        adapter_only.check_trained(state, describe(edl_state.model(state)))
    _write_and_commit(
        root,
        final,
        state,
        json.loads(meta_text),
        _Contents(describe(edl_state.model(state)), float_dtype, save_optimizer, tokenizer, base),
        sharded=sharded,
        keep=keep,
    )
    return final


@dataclasses.dataclass(frozen=True)
class _Contents:
    """What a save writes besides the state itself (``save_state``'s arguments), and the
    model's manifest, computed once."""

    manifest: Manifest
    float_dtype: DTypeLike | None
    save_optimizer: bool
    tokenizer: Tokenizer | None
    base: BaseReference | None = None


def _write_and_commit(
    root: Path,
    final: Path,
    state: TrainState,
    metadata: Any,
    contents: _Contents,
    *,
    sharded: bool,
    keep: int | None,
) -> None:
    """Every process writes its files into one temporary directory; once all have (a
    barrier), process 0 writes ``state.json``, renames the directory to ``final`` and
    prunes; a last barrier holds every process until the checkpoint counts."""
    step = int(state.step)
    lead = jax.process_index() == 0
    token = _shared_token(step)
    tmp = root / f"{_TMP}{step:08d}-{token}"
    if lead:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    sync_processes(f"edl-save-{token}-begin")
    try:
        if sharded:
            info = _write_sharded(tmp, state, contents)
            _fsync_files(tmp, sharded_io.file_prefix("", jax.process_index()))
            sync_processes(f"edl-save-{token}-written")  # every process's pieces are on disk
        else:
            info = _write_contents(tmp, state, contents, final)
        if lead:
            info["metadata"] = metadata
            _fsync_files(tmp, "")
            write_json_atomic(tmp / STATE_NAME, info)  # fsync'd; the checkpoint is complete
            fsync(tmp)
            _replace_atomically(tmp, final)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lead:
        _prune(root, final, keep)
    sync_processes(f"edl-save-{token}-done")  # no process goes on before the checkpoint counts


_saves = itertools.count()  # every process saves as often as the others: same numbers


def _shared_token(step: int) -> str:
    """A fresh hex token, process 0's in every process (the temporary directory's name)."""
    return broadcast_text(f"edl/save/{next(_saves)}/{step}", uuid.uuid4().hex[:12])


def _fsync_files(directory: Path, marker: str) -> None:
    """fsync the files under ``directory`` whose names contain ``marker``."""
    for file in directory.rglob(f"*{marker}*" if marker else "*"):
        if file.is_file():
            fsync(file)


def _info(
    state: TrainState,
    contents: _Contents,
    model_format: str,
    model_files: list[str],
    has_optimizer: bool,
    tokenizer_files: list[str],
) -> dict[str, Any]:
    """``state.json``'s fields but ``metadata`` (and a sharded save's
    ``"optimizer_files"``)."""
    float_dtype = contents.float_dtype
    base = {} if contents.base is None else {"base": contents.base.to_json()}
    return {
        "step": int(state.step),
        "format": FORMAT,
        "edl_version": tensors.edl_version(),
        "model_format": model_format,
        "has_optimizer": has_optimizer,
        "float_dtype": None if float_dtype is None else np.dtype(float_dtype).name,
        "model_files": model_files,
        "layers": contents.manifest.to_json()["layer_structure"],
        "manifest": contents.manifest.to_json(),
        "tokenizer_files": tokenizer_files,
        **base,
    }


def _write_sharded(tmp: Path, state: TrainState, contents: _Contents) -> dict[str, Any]:
    """Write this process's pieces (and, from process 0, ``shards.json``, the model's
    ``config.json`` and the tokenizer's files) into ``tmp``; return ``state.json``'s fields
    but ``metadata``."""
    model = edl_state.model(state)
    arrays = tensors.arrays_of(model, "model")
    if contents.base is not None:  # the adapters' pieces alone
        arrays = {p: x for p, x in arrays.items() if edl_lora.lora_trainable.search(p)}
    sections = {_MODEL: sharded_io.write_pieces(tmp, _MODEL, arrays, contents.float_dtype)}
    has_optimizer = contents.save_optimizer and state.opt_state is not None
    if has_optimizer:
        arrays = tensors.arrays_of(state.opt_state, "opt_state")
        sections[_OPTIMIZER] = sharded_io.write_pieces(tmp, _OPTIMIZER, arrays, None)
    lead = jax.process_index() == 0
    if lead:
        sharded_io.write_index(tmp, sections)
        if contents.manifest.registered:  # for tools that rebuild or export the model
            floats = {
                v["dtype"]
                for v in sections[_MODEL].values()
                if jnp.issubdtype(np.dtype(v["dtype"]), jnp.floating)
            }
            generation = getattr(model, "generation_config", ())
            stored = floats.pop() if len(floats) == 1 else None
            hf.write_config(contents.manifest, tmp, stored, generation=generation)
    prefixes = {
        kind: [sharded_io.file_prefix(kind, p) for p in range(jax.process_count())]
        for kind in (_MODEL, _OPTIMIZER)
    }
    tokenizer_files = hf.save_tokenizer(contents.tokenizer, tmp) if lead else []
    info = _info(state, contents, "sharded", prefixes[_MODEL], has_optimizer, tokenizer_files)
    return {**info, "optimizer_files": prefixes[_OPTIMIZER] if has_optimizer else []}


def _write_contents(
    tmp: Path, state: TrainState, contents: _Contents, final: Path
) -> dict[str, Any]:
    """Write the model (HF layout when its family has one, ``edl.io.model_files``), the
    tokenizer's files and the optimizer state into ``tmp``, which becomes ``final``; return
    ``state.json``'s fields but ``metadata``."""
    model, manifest = edl_state.model(state), contents.manifest
    if contents.base is not None:
        model_files = adapter_only.write_adapters(
            tmp, model, manifest, contents.base, contents.float_dtype
        )
    elif manifest.registered:
        # The adapter's base is this very directory (transformers 5 reads it from here anyway).
        model_files = write_model_files(
            model,
            tmp,
            dtype=contents.float_dtype,
            base_model_name_or_path=str(final.resolve()),
            manifest=manifest,
        )
    else:
        host = tensors.host_tensors(tensors.arrays_of(model, "model"), contents.float_dtype)
        save_tensors(host, tmp, prefix=_MODEL)
        model_files = [_MODEL]
    has_optimizer = contents.save_optimizer and state.opt_state is not None
    if has_optimizer:
        host = tensors.host_tensors(tensors.arrays_of(state.opt_state, "opt_state"), None)
        save_tensors(host, tmp, prefix=_OPTIMIZER)
    model_format = "hf" if manifest.registered else "tree"
    model_format = adapter_only.ADAPTER_FORMAT if contents.base is not None else model_format
    tokenizer_files = hf.save_tokenizer(contents.tokenizer, tmp)
    return _info(state, contents, model_format, model_files, has_optimizer, tokenizer_files)


def _targets(tree: PyTree) -> dict[str, Any]:
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


def _read_tree(checkpoint: Path, prefix: str, targets: Mapping[str, Any]) -> dict[str, jax.Array]:
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


def _fill(tree: PyTree, loaded: Mapping[str, Any]) -> PyTree:
    return edl_tree.named_map(
        lambda p, x: loaded[p] if p in loaded and edl_tree.is_array_like(x) else x, tree
    )


def _read_model(
    checkpoint: Path, info: dict[str, Any], model: Any, base: BaseReference | None
) -> dict[str, jax.Array]:
    """The model arrays ``checkpoint`` holds for ``model`` (``like``'s), by edl path: all of
    them, or an adapter-only checkpoint's adapters (its base must be ``base``'s)."""
    targets = _targets(model)
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
        return _read_tree(checkpoint, _MODEL, targets)
    if model_format == "sharded":
        return sharded_io.read_pieces(checkpoint, _MODEL, targets)
    raise ValueError(f"load_state: {checkpoint}: unknown model_format {model_format!r}")


def _resolve(directory: Path) -> Path:
    if (directory / STATE_NAME).exists():
        return directory
    found = latest_checkpoint(directory)
    if found is None:
        what = "does not exist" if not directory.exists() else "holds no complete checkpoint"
        raise FileNotFoundError(
            f"load_state: {directory} {what} (a complete checkpoint is a checkpoint-* "
            f"directory with a readable {STATE_NAME})"
        )
    return found


def load_state(
    directory: str | os.PathLike[str],
    like: TrainState,
    *,
    allow_missing_optimizer: bool = False,
    base: BaseReference | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """Load a checkpoint into the structure of ``like``; return ``(state, metadata)``.

    ``directory`` is a checkpoint directory, or a parent of ``checkpoint-*`` directories
    (then the newest complete one is loaded). ``like`` (concrete or abstract, e.g. from
    ``jax.eval_shape``) gives the structure, dtypes and placement: every array is checked
    against it before data is read (missing, unexpected and mis-shaped paths raise one
    ``ValueError``), cast to its dtype and, where the leaf has a sharding, put there.

    The optimizer state is loaded when ``like.opt_state`` is not ``None``. If the checkpoint
    has none but ``like.opt_state`` holds arrays, this raises unless
    ``allow_missing_optimizer=True``, which keeps ``like.opt_state`` (a fresh optimizer).
    ``metadata`` is what :func:`save_state` was given (``{}`` if nothing). A file named by
    ``state.json`` outside the checkpoint raises ``ValueError`` (``check_named_files``).

    An adapter-only checkpoint (``save_state(..., base=ref)``) holds no base model: its base
    is ``like``'s (concrete) arrays, and ``base`` must be the reference to the base ``like``
    was built from (``edl.io.formats.base_ref.reference``, computed when it was loaded); a
    base whose weights hash differently, or none, is refused, naming both hashes and the
    checkpoint's ``state.json``. ``base`` is ignored for a checkpoint holding its base.
    """
    checkpoint = _resolve(Path(directory))
    info = _read_info(checkpoint)
    if info is None:  # read again for the reason, naming the file
        read_json(checkpoint / STATE_NAME, what="checkpoint state")
        raise ValueError(
            f"load_state: {checkpoint / STATE_NAME} lacks an integer 'step' or a 'format'"
        )
    if info["format"] != FORMAT:
        raise ValueError(
            f"load_state: {checkpoint} has checkpoint format {info['format']!r}; this edl "
            f"reads format {FORMAT}"
        )
    check_named_files(checkpoint, info)

    loaded = _read_model(checkpoint, info, edl_state.model(like), base)
    model_format = info.get("model_format")
    opt_state = like.opt_state
    if like.opt_state is not None:
        opt_targets = _targets(like.opt_state)
        if info.get("has_optimizer"):
            read = sharded_io.read_pieces if model_format == "sharded" else _read_tree
            opt_state = _fill(like.opt_state, read(checkpoint, _OPTIMIZER, opt_targets))
        elif opt_targets and not allow_missing_optimizer:
            raise ValueError(
                f"load_state: {checkpoint} has no optimizer state (saved with "
                f"save_optimizer=False) but like.opt_state holds {len(opt_targets)} arrays "
                f"(e.g. {next(iter(opt_targets))!r}); pass allow_missing_optimizer=True to "
                "start from like.opt_state"
            )

    step = np.asarray(info["step"], np.dtype(like.step.dtype))
    step = jax.device_put(step, getattr(like.step, "sharding", None))
    state = edl_state.replace(
        like,
        step=step,
        params=_fill(like.params, loaded),
        other=_fill(like.other, loaded),
        opt_state=opt_state,
    )
    metadata = info.get("metadata")
    return state, dict(metadata) if isinstance(metadata, dict) else {}
