"""The Pallas flash kernel with attention sinks (GPT-OSS) against float64 autodiff of the
plain reference: output and the gradients of q, k, v and the sinks (interpreted on CPU,
through Triton on a GPU), and its lowering to Triton from this CPU machine.

Tolerances as in tests/test_kernels_attention.py: errors relative to max(1, max |expected|),
2e-5 for float32 (float32 accumulation over at most ~40 keys), 3e-2 for bfloat16.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl.kernels import BlockSizes, flash_attention
from edl.ops.attention import reference_attention

# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there): the
# Triton kernels' tests; the TPU kernel's (interpret mode, TPU lowering) are not marked, as
# tests/test_kernels_tpu_flash.py's.


def _rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(
        np.max(np.abs(actual - expected), initial=0.0) / max(1.0, np.abs(expected).max(initial=0.0))
    )


def _inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim):
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    q, k, v, d_out = (rng.standard_normal(s) for s in (q_shape, kv_shape, kv_shape, q_shape))
    return q, k, v, 2.0 * rng.standard_normal(heads), d_out


def _float64_autodiff(q, k, v, sinks, d_out, segment_ids, **kw):
    """Output and (dq, dk, dv, d sinks) by jax autodiff of ``reference_attention`` in
    float64, on the CPU (a GPU's cuBLAS may have no float64 GEMM)."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, sinks, d_out)]
        segs = None if segment_ids is None else tuple(jnp.asarray(s) for s in segment_ids)

        @jax.jit
        def run(q, k, v, sinks, d_out, segs):
            fn = functools.partial(reference_attention, segment_ids=segs, **kw)
            out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, sinks=s), q, k, v, sinks)
            return out, vjp(d_out)

        out, grads = run(*args, segs)
        return np.asarray(out), [np.asarray(g) for g in grads]


def _kernel(q, k, v, sinks, d_out, segment_ids, dtype, blocks, **kw):
    @jax.jit
    def run(q, k, v, sinks, d_out, segment_ids):
        q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
        fn = functools.partial(
            flash_attention, q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_sizes=blocks, **kw
        )
        out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, sinks=s), q, k, v, sinks)
        return out, vjp(d_out)

    arrays = [jnp.asarray(a, jnp.float32).astype(dtype) for a in (q, k, v)]
    segs = None if segment_ids is None else tuple(jnp.asarray(s) for s in segment_ids)
    return run(*arrays, jnp.asarray(sinks, jnp.float32), jnp.asarray(d_out, dtype), segs)


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    return {
        "batch": draw(st.integers(1, 2)),
        "q_len": draw(st.integers(1, 30)),
        "kv_len": draw(st.integers(1, 30)),
        "heads": kv_heads * draw(st.sampled_from([1, 2])),
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8])),
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 12)),
        "segments": draw(st.booleans()),
        "blocks": BlockSizes(*(draw(st.sampled_from([4, 8, 16])) for _ in range(4))),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@pytest.mark.gpu
@settings(max_examples=2, deadline=None)  # every example compiles three kernels
@given(cases())
def test_flash_attention_with_sinks_matches_float64_autodiff(c):
    shape = {k: c[k] for k in ("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim")}
    q, k, v, sinks, d_out = _inputs(c["seed"], **shape)
    segments = None
    if c["segments"]:  # sorted ids in {0, 1, 2}: some queries see no key
        rng = np.random.default_rng(c["seed"] + 1)
        segments = tuple(
            np.sort(rng.integers(0, 3, (c["batch"], n), np.int32), axis=1)
            for n in (c["q_len"], c["kv_len"])
        )
    kw = {"causal": c["causal"], "window": c["window"]}
    out, grads = _kernel(q, k, v, sinks, d_out, segments, jnp.float32, c["blocks"], **kw)
    ref_out, ref_grads = _float64_autodiff(q, k, v, sinks, d_out, segments, **kw)
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        err = _rel_err(actual, expected)
        assert err < 2e-5, f"{name}: relative error {err:.2e} ({c})"


@pytest.mark.gpu
@pytest.mark.slow  # ~5 s; the float32 check above runs by default
def test_flash_attention_with_sinks_bfloat16():
    q, k, v, sinks, d_out = _inputs(3, 2, 40, 40, 4, 2, 16)
    out, grads = _kernel(
        q, k, v, sinks, d_out, None, jnp.bfloat16, BlockSizes(16, 16, 16, 16), causal=True
    )
    rounded = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (q, k, v, d_out)]
    ref_out, ref_grads = _float64_autodiff(*rounded[:3], sinks, rounded[3], None, causal=True)
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert _rel_err(actual, expected) < 3e-2, name


@pytest.mark.gpu
def test_attention_op_takes_sinks_through_the_pallas_kernel():
    """``edl.ops.attention(impl="pallas")`` passes the sinks to the kernel."""
    from edl import ops

    q, k, v, sinks, _ = _inputs(5, 1, 9, 9, 4, 2, 8)
    q, k, v = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
    sinks = jnp.asarray(sinks, jnp.float32)
    out = jax.jit(lambda *a: ops.attention(*a[:3], causal=True, sinks=a[3], impl="pallas"))(
        q, k, v, sinks
    )
    ref = ops.attention(q, k, v, causal=True, sinks=sinks, impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_flash_attention_with_sinks_lowers_to_triton():
    def loss(q, k, v, sinks):
        out = flash_attention(q, k, v, causal=True, window=128, sinks=sinks, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    text = jax.jit(grad).trace(q, kv, kv, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_tpu_flash_attention_with_sinks_matches_float64_autodiff():
    """The TPU kernel in Pallas' TPU interpret mode, with segments that leave some queries
    without any key (their lse stays +inf around the sinks)."""
    from jax.experimental.pallas import tpu as pltpu

    from edl.kernels.tpu.flash_attention import BlockSizes as TpuBlocks
    from edl.kernels.tpu.flash_attention import flash_attention as tpu_flash

    q, k, v, sinks, d_out = _inputs(11, 1, 20, 30, 4, 2, 8)
    rng = np.random.default_rng(12)
    segments = tuple(np.sort(rng.integers(0, 3, (1, n), np.int32), axis=1) for n in (20, 30))
    kw = {"causal": True, "window": 9}

    @jax.jit
    def run(q, k, v, sinks, d_out, q_ids, kv_ids):
        fn = functools.partial(
            tpu_flash,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            block_sizes=TpuBlocks(128, 128, 128, 128),
            interpret=pltpu.InterpretParams(),
            **kw,
        )
        out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, sinks=s), q, k, v, sinks)
        return out, vjp(d_out)

    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, sinks, d_out)]
    out, grads = run(*args, *(jnp.asarray(s) for s in segments))
    ref_out, ref_grads = _float64_autodiff(q, k, v, sinks, d_out, segments, **kw)
    assert np.any(np.all(ref_out == 0, axis=(2, 3)))  # some queries see no key
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert not np.isnan(np.asarray(actual)).any(), name
        assert _rel_err(actual, expected) < 2e-5, name


def test_tpu_flash_attention_with_sinks_lowers_for_tpu():
    from edl.kernels.tpu.flash_attention import flash_attention as tpu_flash

    def loss(q, k, v, sinks):
        out = tpu_flash(q, k, v, causal=True, window=256, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 512, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    text = jax.jit(grad).trace(q, kv, kv, sinks).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dq, dk/dv


@pytest.mark.gpu
@pytest.mark.parametrize("new_tokens", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_decode_kernels_with_sinks_match_the_reference(new_tokens):
    """The Pallas decode kernels (contiguous and paged; interpreted on CPU) with sinks as one
    more split of their merge, against ``masked_attention`` with the sinks; GQA of 3 query
    heads per kv head, rows of different lengths, a sliding window."""
    from edl import ops

    rng = np.random.default_rng(21)
    batch, cache_len, kv_heads, group, dim, page = 3, 32, 2, 3, 8, 16
    q = jnp.asarray(rng.standard_normal((batch, new_tokens, kv_heads * group, dim)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((batch, cache_len, kv_heads, dim)), jnp.float32)
        for _ in range(2)
    )
    sinks = jnp.asarray(2.0 * rng.standard_normal(kv_heads * group), jnp.float32)
    lengths = jnp.asarray([5, 32, 17], jnp.int32)
    kw = {"window": 9, "sinks": sinks}
    ref = ops.cached_attention(q, k, v, lengths, impl="reference", **kw)
    out = jax.jit(lambda *a: ops.cached_attention(*a, impl="pallas", **kw))(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # The same cache as pages: row b's page p at pool index b * 2 + p.
    pages = [x.reshape(batch * cache_len // page, page, kv_heads, dim) for x in (k, v)]
    table = jnp.arange(batch * 2, dtype=jnp.int32).reshape(batch, 2)
    paged = jax.jit(lambda *a: ops.paged_attention(*a, impl="pallas", **kw))(
        q, *pages, table, lengths
    )
    np.testing.assert_allclose(np.asarray(paged), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # Sinks change the output (not a test that cannot fail).
    plain = ops.cached_attention(q, k, v, lengths, impl="reference", window=9)
    assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 1e-3


@pytest.mark.gpu
def test_decode_kernels_with_sinks_lower_to_triton():
    from edl.kernels.decode_attention import decode_attention
    from edl.kernels.paged_attention import paged_decode_attention

    def run(q, k, v, lengths, sinks):
        return decode_attention(q, k, v, lengths, window=128, sinks=sinks, interpret=False)

    def run_paged(q, k, v, table, lengths, sinks):
        return paged_decode_attention(q, k, v, table, lengths, sinks=sinks, interpret=False)

    q = jax.ShapeDtypeStruct((2, 1, 32, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    sinks = jax.ShapeDtypeStruct((32,), jnp.float32)
    lower = lambda fn, *a: jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    assert lower(run, q, cache, cache, lengths, sinks).count("__gpu$xla.gpu.triton") == 1
    pool = jax.ShapeDtypeStruct((64, 16, 8, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    text = lower(run_paged, q, pool, pool, table, lengths, sinks)
    assert text.count("__gpu$xla.gpu.triton") == 1
