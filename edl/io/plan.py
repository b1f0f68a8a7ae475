"""Matching HF-named tensors to an edl model's arrays through a key table, before any read.

``plan_load(table, targets, source)`` checks every tensor of ``source`` against the model's
arrays (``targets``: edl path -> shape/dtype) and raises one error listing every missing,
unexpected, duplicated and mis-shaped key. The returned ``LoadPlan`` then fills one
preallocated buffer per edl array (``plan.read(path, buffer)``): a stacked array receives
each layer's (and expert's) tensor in its slot, a fused tensor is read once per array it
feeds and split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from edl.io.safetensors import CheckpointReader
from edl.models.keymap import KeyTable, Placement

__all__ = ["LoadPlan", "MappingSource", "ReaderSource", "TensorSource", "plan_load"]


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors readable one at a time (a checkpoint reader or an in-memory mapping)."""

    def keys(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> np.dtype: ...
    def read_into(self, name: str, out: np.ndarray) -> None: ...


class ReaderSource:
    """A ``CheckpointReader``'s tensors."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

    def keys(self) -> list[str]:
        return list(self.reader.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.info(name).shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.reader.info(name).dtype)

    def read_into(self, name: str, out: np.ndarray) -> None:
        self.reader.read_into(name, out)


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


class MappingSource:
    """An in-memory ``name -> array`` mapping (numpy, jax or torch tensors)."""

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self.mapping = mapping
        self._meta = {k: (tuple(v.shape), _dtype_of(v)) for k, v in mapping.items()}

    def keys(self) -> list[str]:
        return list(self.mapping)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> np.dtype:
        return self._meta[name][1]

    def read_into(self, name: str, out: np.ndarray) -> None:
        out[...] = _to_numpy(self.mapping[name]).astype(out.dtype, copy=False)


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
    skip: frozenset[str] = frozenset(),
) -> LoadPlan:
    """Check ``source`` against ``targets`` through ``table``; one ``ValueError`` lists every
    missing, unexpected, duplicated and mis-shaped key. ``skip``: source keys to pass over
    (e.g. a stored copy of a tied head)."""
    covered = {p: np.zeros(t.shape[: table.stack_depth(p)], np.bool_) for p, t in targets.items()}
    fills: dict[str, list[_Fill]] = {p: [] for p in targets}
    unexpected, mismatched, duplicated = [], [], []
    for key in list(source.keys()):  # a protocol method, not a dict
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
        (f"{len(names)} {title} keys:\n  " + "\n  ".join(sorted(names)[:50])
         + (f"\n  ... and {len(names) - 50} more" if len(names) > 50 else ""))
        for title, names in (("missing", missing), ("unexpected", unexpected),
                             ("duplicated", duplicated), ("shape/dtype mismatch", mismatched))
        if names
    ]  # fmt: skip
    if problems:
        raise ValueError("checkpoint does not match the model:\n" + "\n".join(problems))
    return LoadPlan(source, {p: tuple(f) for p, f in fills.items()})
