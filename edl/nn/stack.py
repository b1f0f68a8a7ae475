"""Stacked layers: one module whose array leaves carry a leading layer axis, run by
``jax.lax.scan`` (compile time flat in depth) or unrolled (identical outputs).

``stack(make_layer, keys)`` builds the stack with ``eqx.filter_vmap``; ``run_stack`` applies
it to a carry. Layers may differ in static per-layer *settings* (a sliding window) and, in
models with several kinds of layer, in structure (one stack per kind, a *group*; e.g.
Qwen3-MoE's dense layers among MoE layers). ``run_stack`` finds the schedule's period: a
pattern that repeats (Gemma 2's sliding / global alternation, an MoE layer every other
layer) is one scan over blocks of a period's layers; a schedule without one (Qwen2's full
layers, then sliding ones) scans each run of equal layers in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Key, PRNGKeyArray, PyTree

__all__ = [
    "REMAT_POLICIES",
    "RematPolicy",
    "map_stacked",
    "num_layers",
    "remat_policy",
    "run_stack",
    "schedule_period",
    "stack",
    "unstack",
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


def unstack(layers: PyTree) -> tuple[PyTree, ...]:
    """A stack's layers as a tuple of separate modules, each array sliced once.

    ``run_stack`` runs such a tuple unrolled without slicing anything. Inside a loop that
    applies the same stack many times (the decode loop of ``edl.generate``), unstacking
    once before the loop saves copying every weight out of the stack on every iteration,
    which XLA does not hoist by itself."""
    arrays, static = eqx.partition(layers, eqx.is_array)
    return tuple(
        eqx.combine(jax.tree.map(lambda x, i=i: x[i], arrays), static)
        for i in range(num_layers(layers))
    )


def num_layers(layers: PyTree) -> int:
    """Length of the leading (layer) axis shared by every array leaf of a stack (or the
    length of an ``unstack``ed tuple)."""
    if isinstance(layers, tuple):
        return len(layers)
    sizes = {x.shape[0] for x in jax.tree.leaves(layers) if eqx.is_array_like(x) and x.ndim}
    if len(sizes) != 1:
        raise ValueError(f"not a layer stack: leading axes {sorted(sizes)} differ")
    return sizes.pop()


def schedule_period(schedule: Sequence[Hashable]) -> int:
    """The smallest ``p <= len // 2`` with ``schedule[i] == schedule[i % p]`` for every ``i``
    (a repeating pattern, possibly cut short at the end), else ``len(schedule)``."""
    n = len(schedule)
    for p in range(1, n // 2 + 1):
        if all(schedule[i] == schedule[i % p] for i in range(n)):
            return p
    return n


def _runs(schedule: Sequence[Hashable], start: int, end: int) -> list[tuple[int, int]]:
    """``[a, b)`` spans of consecutive equal entries within ``[start, end)``."""
    spans, a = [], start
    for i in range(start + 1, end + 1):
        if i == end or schedule[i] != schedule[a]:
            spans.append((a, i))
            a = i
    return spans


def run_stack(
    layers: PyTree | Mapping[str, PyTree],
    carry: PyTree,
    apply: Callable[[Any, PyTree, Any, Array], PyTree],
    *,
    settings: Sequence[Any] | None = None,
    groups: Sequence[str] | None = None,
    scan: bool = True,
    remat: str = "none",
    collect: bool = False,
) -> tuple[PyTree, PyTree | None]:
    """Run ``carry = apply(layer, carry, setting, index)`` through every layer, in order.

    Args:
        layers: a stack from ``stack`` (array leaves ``(num_layers, ...)``), or with
            ``groups`` a mapping ``group -> stack``. A stack may also be ``unstack``ed (a
            tuple of layers): then every layer runs unrolled, whatever ``scan`` says.
        carry: the running state, any pytree: hidden states ``(batch, seq, dim)``, or those
            plus a KV cache that each layer updates at its ``index``.
        apply: ``(layer, carry, setting, index) -> carry`` for one unstacked layer; ``index``
            is the layer's position in the whole model (an int32 scalar). Anything ``apply``
            closes over (RoPE tables, masks) is shared by all layers.
        settings: per-layer static values passed to ``apply`` (e.g. sliding windows).
            Default: ``None`` for every layer.
        groups: the group of each layer: layer ``i`` is the next unused layer of
            ``layers[groups[i]]``. Default: one stack.
        scan: ``lax.scan`` over layers (over blocks of a repeating schedule, else over runs
            of equal layers); ``False`` unrolls a Python loop (same numerics).
        remat: a ``REMAT_POLICIES`` name applied to each layer.
        collect: also return every layer's output carry, stacked ``(num_layers, ...)``.

    Returns:
        ``(carry, outputs)``; ``outputs`` is ``None`` unless ``collect``.
    """
    if groups is None:
        stacks, n = {"": layers}, num_layers(layers)
        groups = [""] * n
    else:
        stacks, n, groups = dict(layers), len(groups), list(groups)
        for g, s in stacks.items():
            if num_layers(s) != groups.count(g):
                raise ValueError(
                    f"run_stack: group {g!r} stacks {num_layers(s)} layers, the schedule "
                    f"names it {groups.count(g)} times"
                )
    settings = [None] * n if settings is None else list(settings)
    if len(settings) != n:
        raise ValueError(f"run_stack: {len(settings)} settings for {n} layers")
    schedule = list(zip(groups, settings, strict=True))
    local = [groups[:i].count(groups[i]) for i in range(n)]  # position within its group
    unrolled = not scan or any(isinstance(s, tuple) for s in stacks.values())
    split = {
        g: eqx.partition(s[0] if isinstance(s, tuple) else s, eqx.is_array)
        for g, s in stacks.items()
    }
    policy = remat_policy(remat)

    def layer_fn(group: str, setting: Any) -> Callable[[PyTree, PyTree, Array], PyTree]:
        static = split[group][1]

        def one(c: PyTree, params: PyTree, index: Array) -> PyTree:
            return apply(eqx.combine(params, static), c, setting, index)

        if remat == "none":
            return one
        return jax.checkpoint(one, policy=policy, prevent_cse=unrolled)

    def params_at(group: str, j: int) -> PyTree:
        s = stacks[group]
        if isinstance(s, tuple):
            return eqx.partition(s[j], eqx.is_array)[0]
        return jax.tree.map(lambda x: x[j], split[group][0])

    def params_of(group: str, start: int, end: int) -> PyTree:
        return jax.tree.map(lambda x: x[start:end], split[group][0])

    indices = jnp.arange(n, dtype=jnp.int32)
    outputs: list[PyTree] = []

    def keep(y: PyTree) -> None:
        if collect:
            outputs.append(y)

    if unrolled:
        for i in range(n):
            carry = layer_fn(*schedule[i])(carry, params_at(groups[i], local[i]), indices[i])
            keep(jax.tree.map(lambda a: a[None], carry))
        return carry, _concat(outputs) if collect else None

    period = schedule_period(schedule)
    # A uniform stack (period 1) is one run below: one scan straight over the layers. Run
    # as blocks of one layer, the stacked decode step measured 2x slower on XLA:CPU.
    blocks = n // period if 1 < period < n else 0
    if blocks:
        pattern = schedule[:period]
        per_block = {g: groups[:period].count(g) for g in stacks}
        xs = {
            g: jax.tree.map(
                lambda x, c=c: x[: blocks * c].reshape(blocks, c, *x.shape[1:]), split[g][0]
            )
            for g, c in per_block.items()
            if c
        }
        fns = [layer_fn(*key) for key in pattern]

        def block(c: PyTree, xs_and_index: tuple[dict[str, PyTree], Array]):
            params, first = xs_and_index
            ys = []
            for k, (g, _) in enumerate(pattern):
                j = groups[:k].count(g)
                c = fns[k](c, jax.tree.map(lambda x, j=j: x[j], params[g]), first + k)
                ys.append(c if collect else None)
            return c, (jax.tree.map(lambda *y: jnp.stack(y), *ys) if collect else None)

        carry, ys = jax.lax.scan(block, carry, (xs, indices[: blocks * period : period]))
        if collect:
            keep(jax.tree.map(lambda y: y.reshape(blocks * period, *y.shape[2:]), ys))
    for start, end in _runs(schedule, blocks * period, n):
        g, setting = schedule[start]
        fn = layer_fn(g, setting)

        def body(c: PyTree, xs: tuple[PyTree, Array], fn=fn):
            c = fn(c, *xs)
            return c, (c if collect else None)

        part = params_of(g, local[start], local[start] + end - start)
        carry, ys = jax.lax.scan(body, carry, (part, indices[start:end]))
        keep(ys)
    return carry, _concat(outputs) if collect else None


def _concat(outputs: list[PyTree]) -> PyTree:
    return jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=0), *outputs)
