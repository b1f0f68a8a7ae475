"""Stacked layers: one module whose array leaves carry a leading layer axis, run by
``jax.lax.scan`` (compile time flat in depth) or unrolled (identical outputs).

``stack(make_layer, keys)`` builds the stack with ``eqx.filter_vmap``; ``run_stack`` applies
it to a carry. Layers may differ in static per-layer *settings* (a sliding window) and, in
models with several kinds of layer, in structure (one stack per kind, a *group*; e.g.
Qwen3-MoE's dense layers among MoE layers). ``run_stack`` is a plan and its execution:
``edl.nn.schedule.plan_schedule`` (pure Python) cuts the schedule into segments, each a block
of layers repeated (a repeating pattern such as Gemma 2's sliding / global alternation is one
segment, blocks of one period; a schedule without one is a segment per run of equal layers),
and ``run_segments`` runs each segment as one ``lax.scan`` over its blocks, or unrolled.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Key, PRNGKeyArray, PyTree

from edl.kernels.native import ATTENTION_LSE, ATTENTION_OUT
from edl.nn.packed_scan import has_packed, packed_scan
from edl.nn.schedule import Segment, plan_schedule
from edl.ops.moe import MOE_OUT, MOE_ROWS
from edl.platforms import carry_platforms, platform_dependent

__all__ = [
    "REMAT_POLICIES",
    "RematPolicy",
    "map_stacked",
    "num_layers",
    "run_segments",
    "run_stack",
    "stack",
    "unstack",
]

RematPolicy = Literal["auto", "none", "full", "dots", "dots_no_batch"]

LOW_RANK = 8
"""A matmul without batch dims whose contracted size times this is at most its output
features is *low-rank* (a LoRA adapter's ``B`` product): the ``"dots"`` policy recomputes
it (from its saved rank-sized input, at most 1/8 of the cost of the product it adds to)
rather than saving an output as wide as the full projection's."""


def _saves_dot(prim: Any, *avals: Any, **params: Any) -> bool:
    """The ``"dots"`` policy's matmuls: every ``dot_general`` but the low-rank ones."""
    if prim is not jax.lax.dot_general_p:
        return False
    (contract, rhs_contract), (batch, _) = params["dimension_numbers"]
    if batch:
        return True
    lhs, rhs = avals[0], avals[1]
    rank = math.prod(lhs.shape[d] for d in contract)
    features = math.prod(n for d, n in enumerate(rhs.shape) if d not in rhs_contract)
    return rank * LOW_RANK > features


# "none": keep every activation; "full": recompute the whole layer in the backward pass;
# "dots": save matmul outputs only (but low-rank ones, ``LOW_RANK``), with the other results
# a backward pass would otherwise recompute at a matmul's cost: the native CPU attention
# kernel's output and log-sum-exp, and an MoE layer's dispatched rows and expert outputs
# (named where they are computed);
# "dots_no_batch": save only matmuls without batch dims (weight-stationary projections),
# recompute attention. "auto" (run_segments) is "dots" lowered for CPU and "none" elsewhere.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        _saves_dot,
        jax.checkpoint_policies.save_only_these_names(
            ATTENTION_OUT, ATTENTION_LSE, MOE_ROWS, MOE_OUT
        ),
    ),
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check_remat(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a remat policy name (``"auto"`` included),
    without resolving ``"auto"``: a config may be built before the backend may be touched
    (``jax.distributed.initialize`` must come first)."""
    if name != "auto" and name not in REMAT_POLICIES:
        choices = sorted([*REMAT_POLICIES, "auto"])
        raise ValueError(f"unknown remat policy {name!r}; choose from {choices}")


def with_remat(
    fn: Callable[..., PyTree], name: str, *, prevent_cse: bool = True
) -> Callable[..., PyTree]:
    """``fn`` under the remat policy ``name`` of ``REMAT_POLICIES`` (``fn`` itself for
    ``"none"``). ``"auto"`` is not one policy: :func:`run_segments` resolves it."""
    check_remat(name)
    if name == "auto":
        raise ValueError("remat 'auto' depends on the lowering platform: run_segments picks it")
    policy = REMAT_POLICIES[name]
    if policy is None:
        return fn
    return jax.checkpoint(carry_platforms(fn), policy=policy, prevent_cse=prevent_cse)


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


# ``apply(layer, carry, setting, index) -> carry``: one layer, as ``run_stack`` calls it.
Apply = Callable[[Any, PyTree, Any, Array], PyTree]


def run_stack(
    layers: PyTree | Mapping[str, PyTree],
    carry: PyTree,
    apply: Apply,
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
            of equal layers: ``plan_schedule``); ``False`` unrolls a Python loop (same
            numerics).
        remat: a ``REMAT_POLICIES`` name applied to each layer.
        collect: also return every layer's output carry, stacked ``(num_layers, ...)``.

    Returns:
        ``(carry, outputs)``; ``outputs`` is ``None`` unless ``collect``.
    """
    if groups is None:
        stacks, groups = {"": layers}, [""] * num_layers(layers)
    else:
        stacks, groups = dict(layers), list(groups)
        for g, s in stacks.items():
            if num_layers(s) != groups.count(g):
                raise ValueError(
                    f"run_stack: group {g!r} stacks {num_layers(s)} layers, the schedule "
                    f"names it {groups.count(g)} times"
                )
    n = len(groups)
    settings = [None] * n if settings is None else list(settings)
    if len(settings) != n:
        raise ValueError(f"run_stack: {len(settings)} settings for {n} layers")
    segments = plan_schedule(groups, settings)
    return run_segments(stacks, segments, carry, apply, scan=scan, remat=remat, collect=collect)


def run_segments(
    stacks: Mapping[str, PyTree],
    segments: Sequence[Segment],
    carry: PyTree,
    apply: Apply,
    *,
    scan: bool = True,
    remat: str = "none",
    collect: bool = False,
) -> tuple[PyTree, PyTree | None]:
    """Execute a plan (``plan_schedule``): each segment as one ``lax.scan`` over its blocks
    or, with ``scan=False`` or any ``unstack``ed group, layer by layer in a Python loop.

    ``stacks`` maps each group of the plan to its stack (or ``unstack``ed tuple);
    ``apply``, ``remat`` and ``collect`` are ``run_stack``'s, and so is the result.

    Remat ``"auto"`` is ``"dots"`` in programs lowered for CPU and ``"none"`` elsewhere: on
    XLA:CPU a scanned stack's saved activations cost more to write and read back than the
    elementwise work that recomputes them (a small Llama's train step 13-15% faster,
    ``benchmarks/RESULTS.md``, "train step: attention on CPU"); on accelerators keeping
    everything stays the default. It is one ``jax.lax.platform_dependent`` around the whole
    run, not around each layer: differentiated, a conditional's residuals are its outputs,
    and a layer's weights saved that way were copied into a stacked buffer on every step
    (scan forwards weights it saves only when they reach it directly). Around the run, each
    branch's scan forwards them, and the zeros the CPU program computes for what only the
    other branch saves are removed by XLA.

    Stacks or a carry holding 16-bit floats are scanned, in programs lowered for CPU, by
    ``edl.nn.packed_scan.packed_scan``: XLA:CPU widens 16-bit data movement to float32, and
    a plain scan of bfloat16 layers held float32 copies of every weight and saved
    activation (``benchmarks/RESULTS.md``, "memory: a LoRA step's peak per precision")."""
    check_remat(remat)
    unrolled = not scan or any(isinstance(s, tuple) for s in stacks.values())
    arrays, statics = {}, {}
    for g, s in stacks.items():
        arrays[g], statics[g] = eqx.partition(s, eqx.is_array)
        if isinstance(s, tuple):  # one layer's static parts stand for all
            statics[g] = statics[g][0]
    run = functools.partial(
        _run_segments, statics, segments, apply=apply, unrolled=unrolled, collect=collect
    )
    packs = not unrolled and has_packed((arrays, carry))
    if remat == "auto" or packs:
        return platform_dependent(
            arrays,
            carry,
            cpu=functools.partial(run, remat="dots" if remat == "auto" else remat, packed=packs),
            default=functools.partial(run, remat="none" if remat == "auto" else remat),
        )
    return run(arrays, carry, remat=remat)


def _run_segments(
    statics: Mapping[str, PyTree],
    segments: Sequence[Segment],
    arrays: Mapping[str, PyTree],
    carry: PyTree,
    *,
    apply: Apply,
    unrolled: bool,
    remat: str,
    collect: bool,
    packed: bool = False,
) -> tuple[PyTree, PyTree | None]:
    """``run_segments`` on the stacks' ``arrays`` and static parts, ``remat`` a policy;
    ``packed``: scans are ``edl.nn.packed_scan.packed_scan`` (16-bit floats as bits)."""

    def layer_fn(group: str, setting: Any) -> Callable[[PyTree, PyTree, Array], PyTree]:
        def one(c: PyTree, params: PyTree, index: Array) -> PyTree:
            return apply(eqx.combine(params, statics[group]), c, setting, index)

        return with_remat(one, remat, prevent_cse=unrolled)

    indices = jnp.arange(segments[-1].stop if segments else 0, dtype=jnp.int32)
    outputs: list[PyTree] = []
    for segment in segments:
        if not unrolled:
            fns = [layer_fn(*kind) for kind in segment.block]
            index = indices[segment.start : segment.stop : len(segment.block)]
            carry, ys = _scan_segment(segment, arrays, fns, carry, index, collect, packed)
            outputs.append(ys)
            continue
        for layer in segment.layers():
            params = _layer_params(arrays[layer.group], layer.local)
            carry = layer_fn(layer.group, layer.setting)(carry, params, indices[layer.index])
            if collect:
                outputs.append(jax.tree.map(lambda a: a[None], carry))
    return carry, _concat(outputs) if collect else None


def _layer_params(arrays: PyTree, j: int) -> PyTree:
    """Layer ``j``'s arrays: an element of an unstacked tuple, or sliced from a stack."""
    if isinstance(arrays, tuple):
        return arrays[j]
    return jax.tree.map(lambda x: x[j], arrays)


def _scan_segment(
    segment: Segment,
    arrays: Mapping[str, PyTree],
    fns: Sequence[Callable[[PyTree, PyTree, Array], PyTree]],
    carry: PyTree,
    index: Int[Array, " repeats"],
    collect: bool,
    packed: bool = False,
) -> tuple[PyTree, PyTree | None]:
    """One ``lax.scan`` over ``segment``'s blocks; ``fns[k]`` runs block layer ``k`` and
    ``index`` holds each block's first global layer index. Returns the carry and, with
    ``collect``, each layer's output ``(repeats * len(block), ...)``."""
    width, repeats = len(segment.block), segment.repeats

    def blocks(group: str) -> PyTree:
        # (repeats, per_block, ...), or (repeats, ...) where a block holds one layer of the
        # group: scanned as blocks of one layer that the body indexes, a uniform stack's
        # decode step is slower on XLA:CPU (benchmarks/RESULTS.md, "generate: unstacked
        # layers, a run_stack regression fixed").
        c, start = segment.per_block(group), segment.offsets[group]
        if c == 1:
            return jax.tree.map(lambda x: x[start : start + repeats], arrays[group])
        return jax.tree.map(
            lambda x: x[start : start + repeats * c].reshape(repeats, c, *x.shape[1:]),
            arrays[group],
        )

    def body(c: PyTree, xs: tuple[dict[str, PyTree], Array]) -> tuple[PyTree, PyTree]:
        params, first = xs
        ys = []
        for k, (group, _) in enumerate(segment.block):
            p, j = params[group], segment.in_block(k)
            if segment.per_block(group) > 1:
                p = jax.tree.map(lambda x, j=j: x[j], p)
            c = fns[k](c, p, first if k == 0 else first + k)
            ys.append(c if collect else None)
        if not collect:
            return c, None
        return c, ys[0] if width == 1 else jax.tree.map(lambda *y: jnp.stack(y), *ys)

    xs = {g: blocks(g) for g in dict.fromkeys(g for g, _ in segment.block)}
    scan = packed_scan if packed else jax.lax.scan
    carry, ys = scan(carry_platforms(body), carry, (xs, index))
    if collect and width > 1:
        ys = jax.tree.map(lambda y: y.reshape(repeats * width, *y.shape[2:]), ys)
    return carry, ys


def _concat(outputs: list[PyTree]) -> PyTree:
    return jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=0), *outputs)
