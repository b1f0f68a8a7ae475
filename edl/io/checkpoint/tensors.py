"""A train state's arrays on their way to safetensors files (``save_state``'s helpers): the
array leaves of a tree, refused when safetensors cannot hold them; lazily copied host
tensors; JSON for metadata; the edl version a checkpoint records."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl import tree as edl_tree
from edl.io.formats.safetensors import LazyTensor

__all__ = ["arrays_of", "edl_version", "host_tensors", "json_default"]


def arrays_of(tree: PyTree, what: str) -> dict[str, Any]:
    """Array leaves by path, refusing what safetensors cannot hold."""
    out = {}
    for path, leaf in edl_tree.flatten(tree).items():
        if not edl_tree.is_array_like(leaf):
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(f"save_state: {what}.{path} is abstract (a ShapeDtypeStruct)")
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"save_state: {what}.{path} is a typed PRNG key array; store "
                "jax.random.key_data(key) instead (or pass it in metadata)"
            )
        out[path] = leaf
    return out


def host_tensors(arrays: Mapping[str, Any], dtype: DTypeLike | None) -> dict[str, LazyTensor]:
    """Tensors copied to the host one at a time while written, floats cast to ``dtype``."""
    out = {}
    for path, x in arrays.items():
        cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        want = np.dtype(dtype if cast else x.dtype)

        def load(x: Any = x, want: np.dtype = want, cast: bool = cast) -> np.ndarray:
            return np.asarray(x.astype(want) if cast else x)

        out[path] = LazyTensor(tuple(x.shape), want, load)
    return out


def json_default(x: Any) -> Any:
    """``json.dumps``' ``default`` for ``state.json``'s metadata: arrays as lists, paths as
    strings; anything else raises ``TypeError`` naming its type."""
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        return x.tolist()
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def edl_version() -> str | None:
    """The edl version ``state.json`` records (``None`` where the package says none)."""
    import edl

    version = getattr(edl, "__version__", None)
    if version is None:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version("edl-jax")
    return version
