"""edl.nn.stack: schedules with per-layer settings and several stacks run every layer once,
in order, with its own weights, setting and global index, whether scanned (over repeating
blocks, then runs), unrolled or unstacked, with or without remat, collecting per-layer
outputs."""

import collections
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.nn.schedule import Segment, schedule_period
from edl.nn.stack import (
    check_remat,
    num_layers,
    run_segments,
    run_stack,
    stack,
    unstack,
)


class Scale(eqx.Module):
    w: jax.Array

    @classmethod
    def init(cls, key):
        return cls(jax.random.normal(key, (3,)))


class Shift(eqx.Module):
    b: jax.Array
    extra: jax.Array

    @classmethod
    def init(cls, key):
        return cls(jax.random.normal(key, (3,)), jnp.ones((2,)))


def _apply(layer, x, setting, index):
    """Distinguishes every input: the layer's weights, the setting and the global index."""
    s = 1.0 if setting is None else float(setting)
    if isinstance(layer, Scale):
        return jnp.tanh(x * layer.w * s) + 0.01 * index.astype(x.dtype)
    return jnp.sin(x + layer.b * s) - 0.02 * index.astype(x.dtype)


def _reference(stacks, groups, settings, x):
    """A plain Python loop, layer by layer."""
    seen = dict.fromkeys(stacks, 0)
    outs = []
    for i, (g, s) in enumerate(zip(groups, settings, strict=True)):
        layer = jax.tree.map(lambda a, j=seen[g]: a[j], stacks[g])
        seen[g] += 1
        x = _apply(layer, x, s, jnp.int32(i))
        outs.append(x)
    return x, jnp.stack(outs)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [((1, 2, 1, 2, 1), 2), ((1, 1, 1), 1), ((1, 2, 2), 3), ((1, 2, 3, 1, 2, 3, 1), 3), ((), 0)],
)
def test_schedule_period(schedule, expected):
    assert schedule_period(schedule) == expected


@pytest.mark.parametrize(
    ("groups", "settings"),
    [
        ("aaaa", (None, 2, None, 2)),  # Gemma 2: alternating settings, one scan over pairs
        ("aaa", (None, 2, None)),  # ... with a tail layer
        ("aba", (None, None, None)),  # two stacks, no repeat: runs
        ("abababab", (None,) * 8),  # two stacks repeating
        ("aabaab", (3, None, None, 3, None, None)),  # period 3, settings and groups
        ("aaab", (None, None, None, None)),  # runs of unequal length
    ],
)
@pytest.mark.parametrize("remat", ["none", "full"])
def test_every_layer_once_in_order(groups, settings, remat):
    n = {g: groups.count(g) for g in "ab"}
    keys = jax.random.split(jax.random.key(0), 2)
    stacks = {"a": stack(Scale.init, jax.random.split(keys[0], n["a"]))}
    if n["b"]:
        stacks["b"] = stack(Shift.init, jax.random.split(keys[1], n["b"]))
    x = jnp.linspace(-1.0, 1.0, 3)
    ref, ref_all = _reference(stacks, groups, settings, x)
    unstacked = {g: unstack(s) for g, s in stacks.items()}
    assert {g: num_layers(s) for g, s in unstacked.items()} == {g: c for g, c in n.items() if c}
    for scan, layers in ((True, stacks), (False, stacks), (True, unstacked)):
        out, per_layer = run_stack(
            layers,
            x,
            _apply,
            settings=settings,
            groups=list(groups),
            scan=scan,
            remat=remat,
            collect=True,
        )
        what = f"scan={scan}, unstacked={layers is unstacked}"
        np.testing.assert_allclose(out, ref, rtol=1e-6, err_msg=what)
        np.testing.assert_allclose(per_layer, ref_all, rtol=1e-6, err_msg=what)

    def loss(stacks, unstacked=False):
        layers = {g: unstack(s) for g, s in stacks.items()} if unstacked else stacks
        return jnp.sum(
            run_stack(layers, x, _apply, settings=settings, groups=list(groups), remat=remat)[0]
            ** 2
        )

    ref_grads = jax.grad(lambda s: jnp.sum(_reference(s, groups, settings, x)[0] ** 2))(stacks)
    for unstacked in (False, True):
        grads = jax.grad(loss)(stacks, unstacked)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scan", [True, False])
def test_run_segments_runs_any_plan(scan):
    """The executor runs whatever plan it is given, not only ``plan_schedule``'s: here
    "aabaab" cut by hand into a block of three, a lone layer and a block of two."""
    groups, settings = "aabaab", (3, None, None, 3, None, None)
    keys = jax.random.split(jax.random.key(1), 2)
    stacks = {
        "a": stack(Scale.init, jax.random.split(keys[0], 4)),
        "b": stack(Shift.init, jax.random.split(keys[1], 2)),
    }
    plan = (
        Segment(0, 1, (("a", 3), ("a", None), ("b", None)), {"a": 0, "b": 0}),
        Segment(3, 1, (("a", 3),), {"a": 2}),
        Segment(4, 1, (("a", None), ("b", None)), {"a": 3, "b": 1}),
    )
    x = jnp.linspace(-1.0, 1.0, 3)
    ref, ref_all = _reference(stacks, groups, settings, x)
    out, per_layer = run_segments(stacks, plan, x, _apply, scan=scan, collect=True)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(per_layer, ref_all, rtol=1e-6)


def test_repeating_schedule_is_one_scan():
    """Compile time stays flat in depth: a repeating schedule is a single scan."""
    layers = stack(Scale.init, jax.random.split(jax.random.key(0), 12))
    settings = (None, 2) * 6
    run = lambda s: run_stack(s, jnp.ones(3), _apply, settings=settings)[0]
    jaxpr = str(jax.make_jaxpr(run)(layers))
    assert jaxpr.count("scan[") == 1


def test_mismatched_groups_are_named():
    stacks = {"a": stack(Scale.init, jax.random.split(jax.random.key(0), 2))}
    with pytest.raises(ValueError, match="group 'a' stacks 2 layers, the schedule names it 3"):
        run_stack(stacks, jnp.ones(3), _apply, groups=["a", "a", "a"])
    with pytest.raises(ValueError, match="3 settings for 2 layers"):
        run_stack(stacks["a"], jnp.ones(3), _apply, settings=(1, 2, 3))


def _ops(remat: str, platform: str) -> collections.Counter:
    """The operations (by name, control flow's bookkeeping aside) of the gradient of a
    stack of ``Scale`` layers run under ``remat``, lowered for ``platform``."""
    layers = stack(Scale.init, jax.random.split(jax.random.key(0), 3))

    def loss(layers, x):
        layer_fn = lambda layer, c, *_: jnp.sin((c * layer.w) @ jnp.ones((3, 3)))
        return jnp.sum(run_stack(layers, x, layer_fn, remat=remat)[0])

    lowered = jax.jit(jax.grad(loss)).trace(layers, jnp.ones(3))
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    names = re.findall(r"(?:stablehlo|func)\.\w+", text)
    return collections.Counter(n for n in names if n not in _BOOKKEEPING)


# Control flow's bookkeeping, and the zeros "auto"'s CPU branch gives for what only the other
# branch saves (XLA removes them; the compiled buffers are those of "dots").
_BOOKKEEPING = {
    "stablehlo.case",
    "stablehlo.return",
    "stablehlo.constant",
    "func.call",
    "func.return",
    "func.func",
    "stablehlo.broadcast_in_dim",
}


def test_remat_auto_is_chosen_by_the_lowering_platform_and_checked_without_a_backend():
    """Remat "auto" is "dots" in a program lowered for CPU and "none" in one lowered for an
    accelerator; checking the name (as a config does when it is built) never touches the
    backend, which multi-process runs initialise first."""
    assert _ops("dots", "cpu") != _ops("none", "cpu")
    assert _ops("auto", "cpu") == _ops("dots", "cpu")
    assert _ops("auto", "cuda") == _ops("none", "cuda")
    assert _ops("auto", "tpu") == _ops("none", "tpu")
    check_remat("auto")
    with pytest.raises(ValueError, match=r"unknown remat policy 'some'; choose from \['auto'"):
        check_remat("some")
    script = (
        "import jax._src.xla_bridge as xb\n"
        "from edl.models import LlamaConfig\n"
        "LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,\n"
        "            num_attention_heads=2)\n"
        "assert not xb._backends, xb._backends\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
