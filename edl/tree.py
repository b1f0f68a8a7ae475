"""Traversals over pytrees as free functions of flattened key paths.

Every pytree (dicts, lists, tuples, ``eqx.Module``s, optax states, ...) has a canonical
string path for each leaf, built from its ``jax.tree_util`` key path::

    >>> flatten({"layers": [{"w": w0}, {"w": w1}]})
    {"layers.0.w": w0, "layers.1.w": w1}

``None`` is an empty subtree in JAX, so it has no path: flattening skips it and
``unflatten(flat, like)`` restores it from ``like``'s structure. This module depends on
nothing else in edl.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

__all__ = [
    "PathKey",
    "ValidationResult",
    "compile_pattern",
    "find",
    "flatten",
    "is_array_like",
    "is_flat",
    "load_into",
    "named_map",
    "named_sharding",
    "path_str",
    "paths",
    "structure_difference",
    "tree_apply",
    "unflatten",
    "validate",
]

logger = logging.getLogger("edl")

IsLeaf = Callable[[Any], bool] | None


@dataclasses.dataclass(frozen=True)
class PathKey:
    """A key entry that stands for a whole key path.

    For pytree nodes that keep deep leaves as direct children (``edl.TrainState``), so their
    paths still read ``"params.layers.0.weight"``.
    """

    path: tuple[Hashable, ...]

    def __str__(self) -> str:
        return jtu.keystr(self.path)


def _expanded(keypath: Sequence[Hashable]) -> Iterator[Hashable]:
    for key in keypath:
        if isinstance(key, PathKey):
            yield from _expanded(key.path)
        else:
            yield key


def path_str(keypath: Sequence[Hashable], sep: str = ".") -> str:
    """Render a ``jax.tree_util`` key path as ``"layers.3.self_attn.q_proj.weight"``.

    Dict keys are rendered with ``str``, attributes by name, sequence entries by index
    (``jax.tree_util.keystr``'s simple form); a ``PathKey`` contributes its whole path.
    """
    return jtu.keystr(tuple(_expanded(keypath)), simple=True, separator=sep)


def is_array_like(x: Any) -> bool:
    """True for leaves that carry a shape and dtype: jax/numpy arrays and ShapeDtypeStructs."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _with_paths(tree: PyTree, sep: str, is_leaf: IsLeaf) -> tuple[list[tuple[str, Any]], Any]:
    """``(path, leaf)`` pairs in flatten order plus the treedef; raises on duplicate paths."""
    pairs, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)
    named = [(path_str(kp, sep), leaf) for kp, leaf in pairs]
    if len({p for p, _ in named}) != len(named):
        seen: dict[str, Any] = {}
        dupes = []
        for kp, _ in pairs:
            p = path_str(kp, sep)
            if p in seen:
                dupes.append(f"  {p!r}: {jtu.keystr(seen[p])} and {jtu.keystr(kp)}")
            else:
                seen[p] = kp
        raise ValueError(
            f"{len(dupes)} leaves render to the same path string with sep={sep!r} (a key "
            "contains the separator, or dict keys differ only in type):\n" + "\n".join(dupes)
        )
    return named, treedef


def is_none(x: Any) -> bool:
    """``is_leaf`` that makes ``None`` a leaf (JAX treats it as an empty subtree)."""
    return x is None


def structure_difference(
    a: PyTree,
    b: PyTree,
    sep: str = ".",
    *,
    names: tuple[str, str] = ("first", "second"),
    none_is_leaf: bool = False,
) -> str | None:
    """``None`` if ``a`` and ``b`` have the same treedef, else a sentence naming where they differ.

    With ``none_is_leaf``, ``None`` counts as a leaf, so trees with ``None`` holes in
    different places (such as ``edl.split``'s two halves) compare equal.
    """
    is_leaf = is_none if none_is_leaf else None
    def_a, def_b = jtu.tree_structure(a, is_leaf=is_leaf), jtu.tree_structure(b, is_leaf=is_leaf)
    if def_a == def_b:
        return None
    pa = [path_str(kp, sep) for kp, _ in jtu.tree_flatten_with_path(a, is_leaf=is_leaf)[0]]
    pb = [path_str(kp, sep) for kp, _ in jtu.tree_flatten_with_path(b, is_leaf=is_leaf)[0]]
    set_a, set_b = set(pa), set(pb)
    only_a = next((p for p in pa if p not in set_b), None)
    only_b = next((p for p in pb if p not in set_a), None)
    if only_a is not None:
        return f"path {only_a!r} is in the {names[0]} but not in the {names[1]}"
    if only_b is not None:
        return f"path {only_b!r} is in the {names[1]} but not in the {names[0]}"
    return f"same paths, different node types:\n  {names[0]}: {def_a}\n  {names[1]}: {def_b}"


def paths(tree: PyTree, sep: str = ".", *, is_leaf: IsLeaf = None) -> list[str]:
    """The path string of every leaf of ``tree``, in flatten order."""
    return [p for p, _ in _with_paths(tree, sep, is_leaf)[0]]


def flatten(tree: PyTree, sep: str = ".", *, is_leaf: IsLeaf = None) -> dict[str, Any]:
    """Flatten ``tree`` to an ordered dict ``path -> leaf`` (leaves are not copied).

    A dict that is already flat maps to an equal dict. Raises ``ValueError`` if two leaves
    would share a path (e.g. a dict key that contains ``sep``).
    """
    return dict(_with_paths(tree, sep, is_leaf)[0])


def find(
    tree: PyTree,
    where: Callable[[Any], bool],
    pattern: str | re.Pattern[str] | None = None,
    sep: str = ".",
) -> dict[str, Any]:
    """The subtrees of ``tree`` for which ``where(node)`` holds, keyed by path, in flatten
    order (a match is not searched inside); with ``pattern``, only those whose path it
    matches (``re.search``). E.g. every ``Linear`` of a model:
    ``find(model, lambda x: isinstance(x, Linear))``. Use ``tree_apply`` (with the same
    ``is_leaf=where``) to replace them."""
    regex = None if pattern is None else compile_pattern(pattern)
    return {
        p: x
        for p, x in flatten(tree, sep, is_leaf=where).items()
        if where(x) and (regex is None or regex.search(p))
    }


def _format_paths(title: str, items: Iterable[str]) -> str:
    items = list(items)
    return f"{len(items)} {title}:\n" + "\n".join(f"  {p}" for p in items) if items else ""


class _Nested:
    def __repr__(self) -> str:
        return "NESTED"


NESTED: Any = _Nested()
"""``unflatten``'s default ``like``: build nested dicts (``None`` is a valid template)."""


def unflatten(
    flat: Mapping[str, Any], like: PyTree = NESTED, sep: str = ".", *, is_leaf: IsLeaf = None
) -> PyTree:
    """Inverse of :func:`flatten`.

    With ``like``, rebuild exactly ``like``'s structure (Modules, tuples, ``None`` holes,
    static fields) from ``flat``'s leaves; ``unflatten(flatten(t), t)`` has ``t``'s treedef
    and the very same leaf objects. Every path of ``like`` must be in ``flat`` and vice
    versa, otherwise a ``ValueError`` names the missing and unexpected paths.

    Without ``like``, build nested dicts by splitting each path on ``sep``.
    """
    if like is NESTED:
        return _nest(flat, sep)
    named, treedef = _with_paths(like, sep, is_leaf)
    want = [p for p, _ in named]
    if len(want) != len(flat) or any(p not in flat for p in want):
        wanted = set(want)
        ValidationResult(
            missing=tuple(p for p in want if p not in flat),
            unexpected=tuple(p for p in flat if p not in wanted),
        ).raise_if_invalid("unflatten: the flat dict")
    return jtu.tree_unflatten(treedef, [flat[p] for p in want])


def _nest(flat: Mapping[str, Any], sep: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split(sep)
        node = out
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"unflatten: {sep.join(parents[: i + 1])!r} is both a leaf and a prefix of "
                    f"{path!r}"
                )
        if last in node:
            raise ValueError(f"unflatten: {path!r} is both a leaf and a prefix of another path")
        node[last] = leaf
    return out


def named_map(
    f: Callable[..., Any], tree: PyTree, *rest: PyTree, sep: str = ".", is_leaf: IsLeaf = None
) -> PyTree:
    """``jax.tree.map`` where ``f(path, leaf, *rest_leaves)`` also gets the leaf's path string."""
    return jtu.tree_map_with_path(
        lambda kp, x, *r: f(path_str(kp, sep), x, *r), tree, *rest, is_leaf=is_leaf
    )


def tree_apply(
    fns: Mapping[str, Callable[[Any], Any]], tree: PyTree, sep: str = ".", *, is_leaf: IsLeaf = None
) -> PyTree:
    """Apply ``fns[path]`` to the leaf at each ``path`` of ``fns``; other leaves are kept.

    Raises ``ValueError`` naming every path of ``fns`` that is not a leaf of ``tree``.
    """
    have = set(paths(tree, sep, is_leaf=is_leaf))
    unknown = [p for p in fns if p not in have]
    if unknown:
        raise ValueError(
            "tree_apply: " + _format_paths("paths are not leaves of the tree", unknown)
        )
    return named_map(lambda p, x: fns[p](x) if p in fns else x, tree, sep=sep, is_leaf=is_leaf)


def is_flat(tree: Any) -> bool:
    """True if ``tree`` is a mapping with string keys whose values are all pytree leaves."""
    return isinstance(tree, Mapping) and all(
        isinstance(k, str) and jtu.treedef_is_leaf(jtu.tree_structure(v)) and v is not None
        for k, v in tree.items()
    )


@dataclasses.dataclass(frozen=True)
class ValidationResult:
    """What differs between a tree and a reference (``like``), by path.

    ``shape_mismatches`` / ``dtype_mismatches`` hold ``(path, expected, actual)``; ``ok`` is
    True when nothing differs. ``raise_if_invalid()`` raises a ``ValueError`` listing all.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    dtype_mismatches: tuple[tuple[str, np.dtype, np.dtype], ...] = ()

    @property
    def ok(self) -> bool:
        return not (
            self.missing or self.unexpected or self.shape_mismatches or self.dtype_mismatches
        )

    def message(self) -> str:
        parts = [
            _format_paths("missing paths", self.missing),
            _format_paths("unexpected paths", self.unexpected),
            _format_paths(
                "shape mismatches (expected vs actual)",
                (f"{p}: {e} vs {a}" for p, e, a in self.shape_mismatches),
            ),
            _format_paths(
                "dtype mismatches (expected vs actual)",
                (f"{p}: {e} vs {a}" for p, e, a in self.dtype_mismatches),
            ),
        ]
        return "\n".join(p for p in parts if p) or "trees match"

    def raise_if_invalid(self, what: str = "tree") -> None:
        if not self.ok:
            raise ValueError(f"{what} does not match the expected structure.\n{self.message()}")


def validate(
    tree: PyTree, like: PyTree, sep: str = ".", *, check_dtype: bool = True, is_leaf: IsLeaf = None
) -> ValidationResult:
    """Compare ``tree`` against ``like`` path by path (either may be nested or flat).

    Shapes and dtypes are compared where both leaves are array-like (arrays or
    ``jax.ShapeDtypeStruct``); other leaves are only checked for presence.
    """
    got = flatten(tree, sep, is_leaf=is_leaf)
    want = flatten(like, sep, is_leaf=is_leaf)
    shapes, dtypes = [], []
    for p, w in want.items():
        if p in got and is_array_like(w) and is_array_like(g := got[p]):
            if tuple(w.shape) != tuple(g.shape):
                shapes.append((p, tuple(w.shape), tuple(g.shape)))
            elif check_dtype and np.dtype(w.dtype) != np.dtype(g.dtype):
                dtypes.append((p, np.dtype(w.dtype), np.dtype(g.dtype)))
    return ValidationResult(
        missing=tuple(p for p in want if p not in got),
        unexpected=tuple(p for p in got if p not in want),
        shape_mismatches=tuple(shapes),
        dtype_mismatches=tuple(dtypes),
    )


def load_into(
    model: PyTree,
    flat: Mapping[str, Any],
    *,
    strict: bool = True,
    cast: bool = True,
    sep: str = ".",
) -> PyTree:
    """Put a flat dict of arrays into ``model`` (EasyDeL's ``merge_model_and_tree``).

    ``model`` may be concrete or abstract (leaves ``jax.ShapeDtypeStruct``, e.g. from
    ``edl.abstract``); only its array-like leaves are targets. Each loaded array gets the
    target's dtype (``cast=True``; otherwise a dtype mismatch is an error) and, when the target
    carries a sharding, is placed with it.

    ``strict=True`` raises one ``ValueError`` naming every missing, unexpected and mis-shaped
    path. ``strict=False`` keeps the model's value for missing paths (an error where that
    value is abstract) and ignores unexpected ones, logging both; shape mismatches are always
    errors.
    """
    flat = flatten(flat, sep)  # accepts nested input too; a flat dict is unchanged
    targets = {p: x for p, x in flatten(model, sep).items() if is_array_like(x)}
    report = validate(flat, targets, sep, check_dtype=not cast)
    if strict:
        report.raise_if_invalid("load_into: the flat dict")
    else:
        abstract_missing = tuple(
            p for p in report.missing if isinstance(targets[p], jax.ShapeDtypeStruct)
        )
        dataclasses.replace(report, missing=abstract_missing, unexpected=()).raise_if_invalid(
            "load_into: the flat dict"
        )
        if report.missing or report.unexpected:
            logger.warning(
                "load_into(strict=False): %s",
                ValidationResult(report.missing, report.unexpected).message(),
            )

    def place(path: str, leaf: Any) -> Any:
        if path not in targets or path not in flat:
            return leaf
        value = flat[path]
        value = value if is_array_like(value) else np.asarray(value)
        if cast and value.dtype != leaf.dtype:
            value = value.astype(leaf.dtype)
        # Host data goes straight to its target sharding: each device receives only its shard.
        sharding = getattr(leaf, "sharding", None)
        return jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)

    return named_map(place, model, sep=sep)


def named_sharding(specs: PyTree, mesh: Mesh) -> PyTree[NamedSharding]:
    """Map a pytree of ``PartitionSpec`` (``None`` holes allowed) to ``NamedSharding``s on ``mesh``.

    Errors name the path of the offending spec.
    """

    def one(path: str, spec: Any) -> NamedSharding:
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"named_sharding: {path!r} holds {type(spec).__name__}, not a PartitionSpec"
            )
        try:
            return NamedSharding(mesh, spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"named_sharding: invalid spec {spec} at {path!r}: {e}") from e

    return named_map(one, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def compile_pattern(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """Compile a path regex, with an error that names the pattern."""
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid path regex {pattern!r}: {e}") from e
