"""Choosing code by the platform a program is lowered for (``edl.platforms``,
``edl.ops.dispatch``): notices and failures happen when, and only when, their branch is
lowered; host checks only where a callback can lower; a kernel that cannot take some inputs
on one platform never stops programs for the others."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from edl import platforms
from edl.kernels import native
from edl.ops import attention, cached_attention
from edl.ops.checks import check_ids
from edl.ops.dispatch import Kernel
from edl.platforms import fail_when_lowered, host_check, notice_when_lowered

attention_module = __import__("edl.ops.attention", fromlist=["KERNELS"])


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(platforms, "_noticed", set())


def _lower(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _on_tpu_only(marker):
    """``x -> platform_dependent(x, tpu=marker, default=identity)``."""
    return lambda x: platforms.platform_dependent(x, tpu=marker, default=lambda x: x)


def test_a_notice_warns_once_when_its_branch_is_lowered_and_never_otherwise():
    fn = _on_tpu_only(lambda x: notice_when_lowered(x + 1, "lowered for {platform}"))
    x = jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(jax.jit(fn)(x), x)  # the CPU program: no notice
        _lower(fn, x, platform="cuda")
    with pytest.warns(UserWarning, match="^lowered for tpu$"):
        text = _lower(fn, x, platform="tpu")
    assert "edl_lowering_notice" not in text  # leaves nothing in the program
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lower(fn, x, platform="tpu")  # once per message
    with pytest.warns(UserWarning, match="^eager on cpu$"):
        notice_when_lowered(x, "eager on {platform}")  # run eagerly: at once


def test_a_failure_raises_when_its_branch_is_lowered_naming_the_platform():
    fn = _on_tpu_only(lambda x: fail_when_lowered(x, "no {platform} kernel for {this}"))
    x = jnp.ones(3)
    np.testing.assert_array_equal(jax.jit(fn)(x), x)
    assert "stablehlo" in _lower(jax.grad(lambda x: fn(x).sum()), x, platform="cuda")
    with pytest.raises(ValueError, match=re.escape("no tpu kernel for {this}")):
        _lower(fn, x, platform="tpu")  # braces other than {platform} are kept as they are


def _report(values):
    """Raise on a negative value; else zeros, one per row (batched under vmap)."""
    values = np.asarray(values)
    if np.any(values < 0):
        raise ValueError(f"negative: {values.min()}")
    return np.zeros(values.shape[:-1], np.int32)


def _checked(x):
    def check(x):
        shape = jax.ShapeDtypeStruct((), jnp.int32)
        bad = jax.pure_callback(_report, shape, x, vmap_method="broadcast_all")
        return x + bad.astype(x.dtype)

    return host_check(x, check=check)


def test_host_check_calls_back_only_where_a_callback_lowers():
    x = jnp.array([1, -2, 3], jnp.int32)
    with pytest.raises(Exception, match="negative: -2"):
        jax.block_until_ready(jax.jit(_checked)(x))
    assert "python_cpu_callback" in _lower(_checked, x, platform="cpu")
    for platform in ("cuda", "tpu"):  # no backend for them here: unchecked, and lowerable
        assert "callback" not in _lower(_checked, x, platform=platform)
    with pytest.raises(Exception, match="negative: -2"):
        _checked(x)  # eagerly
    good = jnp.array([[1, 2], [3, 4]], jnp.int32)
    np.testing.assert_array_equal(jax.jit(jax.vmap(_checked))(good), good)
    with pytest.raises(Exception, match="negative: -1"):
        jax.block_until_ready(jax.jit(jax.vmap(_checked))(good.at[1, 0].set(-1)))


def test_host_check_passes_derivatives_through_as_an_identity():
    def loss(x):
        return jnp.sum(host_check(x, check=lambda x: x * 1.0) ** 2)

    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), 2 * x)


def test_check_ids_lowers_for_accelerators_without_its_callback():
    ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    fn = functools.partial(check_ids, upper=10)
    assert "python_cpu_callback" in _lower(fn, ids, platform="cpu")
    assert "callback" not in _lower(fn, ids, platform="tpu")


def _qkv(head_dim: int, length: int = 16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, length, 4, head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, length, 2, head_dim)), jnp.float32)
    return q, kv


def test_a_gpu_limit_is_said_only_in_the_gpu_program():
    """head_dim 320 fits the interpreted kernel but not Triton's shared memory: CPU runs say
    nothing; lowered for cuda, "auto" warns and holds no Triton call, "pallas" raises."""
    q, kv = _qkv(320)
    auto = functools.partial(attention, causal=True)
    pallas = functools.partial(attention, causal=True, impl="pallas")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(pallas)(q, kv, kv)
        jax.jit(auto)(q, kv, kv)
    with pytest.warns(UserWarning, match="head_dim 320 > 256 .*; using impl='xla'"):
        text = _lower(auto, q, kv, kv, platform="cuda")
    assert "triton" not in text
    with pytest.raises(ValueError, match="impl='pallas' cannot run on cuda: head_dim 320"):
        _lower(pallas, q, kv, kv, platform="cuda")


def test_a_kernel_named_for_another_platform_fails_when_lowered_for_this_one():
    if native.unavailable() is not None:
        pytest.skip(native.unavailable())
    q, kv = _qkv(32)
    fn = functools.partial(attention, causal=True, impl="native")
    assert "edl_flash_attention_forward" in _lower(fn, q, kv, kv, platform="cpu")
    with pytest.raises(ValueError, match=r"impl='native' cannot run on tpu: .*lowered for cpu"):
        _lower(fn, q, kv, kv, platform="tpu")


def test_a_kernel_raising_while_traced_stops_only_its_own_platform(monkeypatch):
    """A ValueError a kernel raises while tracing (a limit its ``unsupported`` missed): the
    CPU program runs, "auto" lowered for that platform falls back with a warning, an impl
    named fails when lowered there."""

    def raising(options, *arrays):
        raise ValueError("the TPU kernel cannot take this (test)")

    kernel = Kernel("pallas", raising, lambda *_: None)
    monkeypatch.setitem(attention_module.KERNELS, "tpu", (kernel,))
    q, kv = _qkv(32)
    auto = functools.partial(attention, causal=True)
    expected = attention(q, kv, kv, causal=True, impl="reference")
    np.testing.assert_allclose(jax.jit(auto)(q, kv, kv), expected, atol=1e-5)
    with pytest.warns(UserWarning, match=r"cannot take this \(test\); using impl='xla'"):
        _lower(auto, q, kv, kv, platform="tpu")
    with pytest.raises(ValueError, match=r"impl='pallas' cannot run on tpu: .*\(test\)"):
        _lower(functools.partial(attention, impl="pallas"), q, kv, kv, platform="tpu")


def test_decode_kernels_follow_the_platform_and_its_limits():
    """A cache of 100 positions: the CPU program reads it with XLA, the TPU one with the
    Mosaic kernel; Triton needs a multiple of 16, so the cuda one falls back, saying why."""
    q = jnp.zeros((2, 1, 4, 32), jnp.float32)
    cache = jnp.zeros((2, 100, 2, 32), jnp.float32)
    lengths = jnp.array([5, 100], jnp.int32)
    args = (q, cache, cache, lengths)
    assert "tpu_custom_call" in _lower(cached_attention, *args, platform="tpu")
    assert "custom_call" not in _lower(cached_attention, *args, platform="cpu")
    with pytest.warns(UserWarning, match="cache length that is a multiple of 16, got 100"):
        assert "triton" not in _lower(cached_attention, *args, platform="cuda")


def test_a_choice_nested_in_a_branch_builds_only_that_branch_s_platforms():
    """Inside the CPU branch a nested choice traces the CPU code alone; inside the default
    branch (cuda, rocm, tpu, others) it traces what those can run."""
    traced = []

    def marker(name):
        return lambda x: (traced.append(name), x + 1.0)[1]

    def inner(x):
        cpu, tpu, other = marker("cpu"), marker("tpu"), marker("other")
        return platforms.platform_dependent(x, cpu=cpu, tpu=tpu, default=other)

    outer = functools.partial(platforms.platform_dependent, cpu=inner, default=inner)
    jax.make_jaxpr(outer)(1.0)
    assert sorted(traced) == ["cpu", "other", "tpu"]  # not each twice
    for platform in ("cpu", "tpu"):
        assert "stablehlo" in _lower(outer, 1.0, platform=platform)
    np.testing.assert_allclose(jax.jit(outer)(1.0), 2.0)


def test_several_platforms_at_once_notice_only_where_their_branch_runs():
    """``jax.export`` for cpu and tpu lowers every branch for both: a notice in the TPU branch
    speaks of tpu alone, a failure in a branch no exported platform runs stays silent."""
    fn = _on_tpu_only(lambda x: notice_when_lowered(x, "on {platform}"))
    never = lambda x: platforms.platform_dependent(
        x, rocm=lambda x: fail_when_lowered(x, "rocm only"), default=lambda x: x
    )
    x = jnp.ones(3)
    with pytest.warns(UserWarning, match="^on tpu$"):
        export.export(jax.jit(fn), platforms=["cpu", "tpu"])(x)
    export.export(jax.jit(never), platforms=["cpu", "tpu"])(x)
    with pytest.raises(ValueError, match="rocm only"):
        export.export(jax.jit(never), platforms=["cpu", "rocm"])(x)


@jax.jit
def _attend(q, k, v):
    """A long-lived jitted function: jax caches its trace by the function alone."""
    return attention(q, k, v, causal=True)


def test_a_long_lived_function_traced_inside_a_branch_keeps_every_platform():
    """Traced first inside the CPU branch, ``_attend``'s cached trace is reused in the other
    branch: it must hold every platform's kernel, so the cuda program gets Triton's."""
    q, kv = _qkv(64, length=128)
    both = lambda q, k, v: platforms.platform_dependent(q, k, v, cpu=_attend, default=_attend)
    text = _lower(both, q, kv, kv, platform="cuda")
    assert "triton" in text
    assert "edl_flash_attention_forward" not in text
