"""Loading HF-named (or edl-named) tensors into an edl model's arrays: plan, then stream.

``plan_load(table, targets, source)`` checks every tensor of ``source`` against the model's
arrays (``targets``: edl path -> shape/dtype) through a key table and raises one error
listing every missing, unexpected, duplicated and mis-shaped key. The returned ``LoadPlan``
says which source tensors fill which slots of each edl array: a stacked array receives each
layer's (and expert's) tensor in its slot, a fused tensor is read once per array it feeds
and split. ``load_arrays(plan, targets)`` then fills one preallocated host buffer per edl
array and sends it to its devices before the next is filled, so peak host memory is one
array, not the checkpoint. Every loader in ``edl.io`` (``from_pretrained``,
``from_state_dict``, ``load_state``, ``load_adapter``) goes through these two functions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from edl.io.formats.safetensors.reader import CheckpointReader
from edl.models.keymap import KeyTable, Placement

__all__ = ["LoadPlan", "TensorSource", "load_arrays", "plan_load"]

_HEAD = "lm_head.weight"  # a tied head's HF name (see plan_load's tie_word_embeddings)


def _to_numpy(value: Any) -> np.ndarray:
    """numpy view of an array-like, torch tensors included (bf16 too); torch is imported only
    when handed a torch tensor."""
    if type(value).__module__.startswith("torch"):
        import torch

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16).numpy().view(jnp.bfloat16)
        return value.numpy()
    return np.asarray(value)


def _dtype_of(value: Any) -> np.dtype:
    if type(value).__module__.startswith("torch"):
        name = str(value.dtype).removeprefix("torch.")
        return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)
    return np.dtype(value.dtype)


def _copy_into(value: Any, out: np.ndarray) -> None:
    out[...] = _to_numpy(value).astype(out.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, ...]
    dtype: np.dtype
    read_into: Callable[[np.ndarray], Any]  # fills a buffer of ``shape``, casting as numpy


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Named tensors, each read on demand into a caller's buffer: a checkpoint's
    (``from_reader``), an in-memory mapping's (``from_mapping``), or both (``a | b``)."""

    tensors: Mapping[str, _Tensor]

    @classmethod
    def from_reader(
        cls, reader: CheckpointReader, names: Mapping[str, str] | None = None
    ) -> TensorSource:
        """``reader``'s tensors; with ``names`` (name -> stored key) only those, renamed."""
        names = {k: k for k in reader} if names is None else names

        def tensor(key: str) -> _Tensor:
            info = reader.info(key)
            read = functools.partial(reader.read_into, key)
            return _Tensor(tuple(info.shape), np.dtype(info.dtype), read)

        return cls({name: tensor(key) for name, key in names.items()})

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> TensorSource:
        """The arrays of a ``name -> array`` mapping (numpy, jax or torch tensors)."""
        return cls(
            {
                k: _Tensor(tuple(v.shape), _dtype_of(v), functools.partial(_copy_into, v))
                for k, v in mapping.items()
            }
        )

    def replaced(
        self,
        drop: Collection[str],
        add: Mapping[str, tuple[tuple[int, ...], Any, Callable[[np.ndarray], Any]]],
    ) -> TensorSource:
        """This source without the tensors ``drop`` and with ``add``: name -> ``(shape,
        dtype, read_into)``, tensors computed from others (``edl.io.formats.mxfp4``)."""
        kept = {k: v for k, v in self.tensors.items() if k not in drop}
        made = {k: _Tensor(tuple(s), np.dtype(d), read) for k, (s, d, read) in add.items()}
        return TensorSource({**kept, **made})

    def __or__(self, other: TensorSource) -> TensorSource:
        return TensorSource({**self.tensors, **other.tensors})

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name].dtype

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Fill ``out`` (the tensor's shape, any dtype: cast as numpy casts) with ``name``."""
        self.tensors[name].read_into(out)


@dataclasses.dataclass(frozen=True)
class _Fill:
    key: str
    index: tuple[int, ...]
    part: tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Which source tensors fill which slots of each edl array (see ``plan_load``)."""

    source: TensorSource
    fills: Mapping[str, tuple[_Fill, ...]]

    @classmethod
    def by_name(cls, source: TensorSource, paths: Collection[str]) -> LoadPlan:
        """Each edl array read whole from the source tensor of its own name (a checkpoint
        keyed by edl paths, checked against the targets by the caller)."""
        return cls(source, {p: (_Fill(p, (), None),) for p in paths})

    def first_key(self, path: str) -> str:
        """A source tensor feeding ``path`` (its stored dtype stands for the array's)."""
        return self.fills[path][0].key

    def read(self, path: str, out: np.ndarray) -> None:
        """Fill ``out`` (the whole edl array ``path``) from the source."""
        for fill in self.fills[path]:
            slot = out[fill.index] if fill.index else out
            if fill.part is None:
                self.source.read_into(fill.key, slot)
                continue
            whole = np.empty(self.source.shape(fill.key), out.dtype)
            self.source.read_into(fill.key, whole)
            axis, k, parts = fill.part
            slot[...] = np.split(whole, parts, axis=axis)[k]


def _expected_shape(target_shape: tuple[int, ...], placement: Placement) -> tuple[int, ...]:
    shape = list(target_shape[len(placement.index) :])
    if placement.part is not None:
        axis, _, parts = placement.part
        if axis >= len(shape):
            return tuple(shape)  # reported as a mismatch
        shape[axis] *= parts
    return tuple(shape)


def plan_load(
    table: KeyTable,
    targets: Mapping[str, jax.ShapeDtypeStruct],
    source: TensorSource,
    *,
    tie_word_embeddings: bool = False,
) -> LoadPlan:
    """Check ``source`` against ``targets`` through ``table``; one ``ValueError`` lists every
    missing, unexpected, duplicated and mis-shaped key. ``tie_word_embeddings``: the model's
    head is its embedding, so a stored copy of the head (``lm_head.weight``, which some
    checkpoints hold anyway) is passed over unless ``targets`` has a head of its own."""
    skip = {_HEAD} if tie_word_embeddings and _HEAD not in targets else set()
    covered = {p: np.zeros(t.shape[: table.stack_depth(p)], np.bool_) for p, t in targets.items()}
    fills: dict[str, list[_Fill]] = {p: [] for p in targets}
    unexpected, mismatched, duplicated = [], [], []
    for key in source.tensors:
        if key in skip or table.ignored(key):
            continue
        try:
            placements = table.to_edl(key)
        except KeyError:
            unexpected.append(key)
            continue
        for placement in placements:
            target = targets.get(placement.path)
            cover = covered.get(placement.path)
            if (
                target is None
                or len(placement.index) > cover.ndim
                or any(i >= n for i, n in zip(placement.index, cover.shape, strict=False))
            ):
                unexpected.append(key)
                break
            slot = cover[placement.index] if placement.index else cover
            if np.any(slot):
                duplicated.append(f"{key} (fills {placement.path}{list(placement.index)} again)")
                continue
            if placement.index:
                cover[placement.index] = True
            else:
                cover[...] = True
            want = _expected_shape(tuple(target.shape), placement)
            if source.shape(key) != want:
                mismatched.append(f"{key}: checkpoint {source.shape(key)}, model expects {want}")
            elif not jnp.issubdtype(source.dtype(key), jnp.floating) and jnp.issubdtype(
                target.dtype, jnp.inexact
            ):
                mismatched.append(f"{key}: checkpoint dtype {source.dtype(key)} is not floating")
            else:
                fills[placement.path].append(_Fill(key, placement.index, placement.part))
    missing = [
        table.to_hf(p, tuple(int(i) for i in idx) or None)
        for p, cover in covered.items()
        for idx in np.argwhere(~cover)
    ]
    problems = [
        (
            f"{len(names)} {title} keys:\n  "
            + "\n  ".join(sorted(names)[:50])
            + (f"\n  ... and {len(names) - 50} more" if len(names) > 50 else "")
        )
        for title, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("duplicated", duplicated),
            ("shape/dtype mismatch", mismatched),
        )
        if names
    ]
    if problems:
        raise ValueError("checkpoint does not match the model:\n" + "\n".join(problems))
    return LoadPlan(source, {p: tuple(f) for p, f in fills.items()})


def load_arrays(
    plan: LoadPlan, targets: Mapping[str, Any], *, progress: bool = False
) -> dict[str, jax.Array]:
    """Every edl array of ``plan`` as a device array shaped, typed and placed as its target.

    ``targets`` maps each edl path of the plan to an array-like (a ``jax.Array`` or
    ``jax.ShapeDtypeStruct``): its ``dtype`` is the buffer's (source tensors are cast as
    numpy casts) and its ``sharding``, where it has one, the placement (else the default
    device). One host buffer at a time: each is sent to its devices, and the transfer waited
    for, before the next is filled. ``progress`` shows a progress bar on a terminal.
    """
    arrays = {}
    paths = tqdm(
        plan.fills, desc="loading", unit="array", disable=None if progress else True, leave=False
    )
    for path in paths:
        target = targets[path]
        buffer = np.empty(target.shape, np.dtype(target.dtype))
        plan.read(path, buffer)
        # Wait for the transfer so this buffer is freed before the next is filled.
        placed = jax.device_put(buffer, getattr(target, "sharding", None))
        arrays[path] = jax.block_until_ready(placed)
        del buffer
    return arrays
