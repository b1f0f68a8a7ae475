"""Stacked layers: one module whose array leaves carry a leading layer axis, run by
``jax.lax.scan`` (compile time flat in depth) or unrolled (identical outputs).

``stack(make_layer, keys)`` builds the stack with ``eqx.filter_vmap``; ``run_stack`` applies
it to a carry. Layers with different static settings (e.g. Qwen2's sliding-window layers
after full-attention ones) are handled by scanning each run of equal settings in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
from jaxtyping import Array, Key, PRNGKeyArray, PyTree

__all__ = [
    "REMAT_POLICIES",
    "RematPolicy",
    "map_stacked",
    "num_layers",
    "remat_policy",
    "run_stack",
    "stack",
]

RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]

# "none": keep every activation; "full": recompute the whole layer in the backward pass;
# "dots": save matmul outputs only; "dots_no_batch": save only matmuls without batch dims
# (weight-stationary projections), recompute attention.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy called ``name`` (``None`` for ``"none"``: no remat)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose from {sorted(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def stack(
    make_layer: Callable[[PRNGKeyArray], eqx.Module], keys: Key[Array, " layers"]
) -> eqx.Module:
    """``make_layer(key)`` for each key, stacked along a new leading axis of every array."""
    return eqx.filter_vmap(make_layer)(keys)


def map_stacked(fn: Callable[..., Any], depth: int) -> Callable[..., Any]:
    """``fn`` applied to every slice along ``depth`` leading axes of its arguments' arrays,
    the results stacked again (nested ``eqx.filter_vmap``; ``depth == 0`` is ``fn``): a
    per-layer transform of one layer module applied to a whole stack."""
    for _ in range(depth):
        fn = eqx.filter_vmap(fn)
    return fn


def num_layers(layers: PyTree) -> int:
    """Length of the leading (layer) axis shared by every array leaf of a stack."""
    sizes = {x.shape[0] for x in jax.tree.leaves(layers) if eqx.is_array_like(x) and x.ndim}
    if len(sizes) != 1:
        raise ValueError(f"not a layer stack: leading axes {sorted(sizes)} differ")
    return sizes.pop()


def _runs(settings: Sequence[Any]) -> list[tuple[int, int]]:
    """``[start, end)`` spans of consecutive equal entries."""
    spans, start = [], 0
    for i in range(1, len(settings) + 1):
        if i == len(settings) or settings[i] != settings[start]:
            spans.append((start, i))
            start = i
    return spans


def run_stack(
    layers: PyTree,
    carry: PyTree,
    apply: Callable[[Any, PyTree, Any, Array], PyTree],
    *,
    settings: Sequence[Any] | None = None,
    scan: bool = True,
    remat: str = "none",
    collect: bool = False,
) -> tuple[PyTree, PyTree | None]:
    """Run ``carry = apply(layer, carry, setting, index)`` through every layer of ``layers``.

    Args:
        layers: a stack from ``stack`` (array leaves ``(num_layers, ...)``).
        carry: the running state, any pytree: hidden states ``(batch, seq, dim)``, or those
            plus a KV cache that each layer updates at its ``index``.
        apply: ``(layer, carry, setting, index) -> carry`` for one unstacked layer; ``index``
            is the layer's position in the stack (an int32 scalar). Anything ``apply``
            closes over (RoPE tables, masks) is shared by all layers.
        settings: per-layer static values passed to ``apply`` (e.g. sliding windows); runs of
            equal settings are scanned together. Default: ``None`` for every layer.
        scan: ``lax.scan`` over layers; ``False`` unrolls a Python loop (same numerics).
        remat: a ``REMAT_POLICIES`` name applied to each layer.
        collect: also return every layer's output carry, stacked ``(num_layers, ...)``.

    Returns:
        ``(carry, outputs)``; ``outputs`` is ``None`` unless ``collect``.
    """
    n = num_layers(layers)
    settings = [None] * n if settings is None else list(settings)
    if len(settings) != n:
        raise ValueError(f"run_stack: {len(settings)} settings for {n} layers")
    policy = remat_policy(remat)
    dynamic, static = eqx.partition(layers, eqx.is_array)
    indices = jax.numpy.arange(n, dtype=jax.numpy.int32)
    outputs = []
    for start, end in _runs(settings):
        setting = settings[start]

        def body(c: PyTree, xs: tuple[PyTree, Array], setting: Any = setting):
            params, index = xs
            c = apply(eqx.combine(params, static), c, setting, index)
            return c, (c if collect else None)

        if remat != "none":
            body = jax.checkpoint(body, policy=policy, prevent_cse=not scan)
        span = slice(start, end)
        part = dynamic if (start, end) == (0, n) else jax.tree.map(lambda x, s=span: x[s], dynamic)
        part = (part, indices[span])
        if scan:
            carry, ys = jax.lax.scan(body, carry, part)
            outputs.append(ys)
        else:
            for i in range(end - start):
                carry, y = body(carry, jax.tree.map(lambda x, i=i: x[i], part))
                outputs.append(None if y is None else jax.tree.map(lambda a: a[None], y))
    if not collect:
        return carry, None
    return carry, jax.tree.map(lambda *ys: jax.numpy.concatenate(ys, axis=0), *outputs)
