"""edl.ops.attention against an independent float64 numpy reference.

The hypothesis tests call ``ops.attention`` jitted whole: run eagerly (and under autodiff),
each of its ops compiles on its own, several times the cost of compiling one program.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl import ops
from edl.kernels import native

# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu


def numpy_attention(q, k, v, *, causal, window, softcap, scale, q_ids, kv_ids):
    """float64; K/V repeated per query head; mask by explicit position arithmetic."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, h // hkv, axis=2)
    v = np.repeat(v, h // hkv, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    allowed = np.ones((b, sq, skv), bool)
    for i in range(sq):
        qpos = i + skv - sq
        for j in range(skv):
            if (causal or window is not None) and j > qpos:
                allowed[:, i, j] = False
            if window is not None and qpos - j >= window:
                allowed[:, i, j] = False
    if q_ids is not None:
        allowed &= np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]
    logits = np.where(allowed[:, None], logits, -np.inf)
    out = np.zeros((b, h, sq, d))
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                row = logits[bi, hi, i]
                if np.isfinite(row).any():
                    p = np.exp(row - row[np.isfinite(row)].max())
                    out[bi, hi, i] = (p / p.sum()) @ v[bi, :, hi]
    return out.transpose(0, 2, 1, 3)


_STATIC = ("causal", "window", "softcap", "scale", "impl")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attention(q, k, v, segment_ids, *, causal, window, softcap, scale, impl):
    return ops.attention(
        q,
        k,
        v,
        causal=causal,
        segment_ids=segment_ids,
        window=window,
        softcap=softcap,
        scale=scale,
        impl=impl,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attention_grads(q, k, v, segment_ids, cotangent, **kw):
    """d sum(attention * cotangent) / d(q, k, v)."""

    def f(q, k, v):
        return jnp.sum(_attention(q, k, v, segment_ids, **kw) * cotangent)

    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    kv_len = draw(st.integers(1, 12))
    q_len = draw(st.integers(1, kv_len))
    return {
        "batch": draw(st.integers(1, 2)),
        "q_len": q_len,
        "kv_len": kv_len,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8])),
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 6)),
        "softcap": draw(st.none() | st.floats(1.0, 30.0)),
        "scale": draw(st.none() | st.floats(0.05, 1.0)),
        "segments": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
@settings(max_examples=5)  # each example compiles new shapes; broadly: the slow twin below
@given(cases())
def test_attention_matches_float64_reference(impl, c):
    _check_against_float64_reference(impl, c)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
@settings(max_examples=30)
@given(cases())
def test_attention_matches_float64_reference_broadly(impl, c):
    _check_against_float64_reference(impl, c)


def _check_against_float64_reference(impl, c):
    rng = np.random.default_rng(c["seed"])
    b, sq, skv = c["batch"], c["q_len"], c["kv_len"]
    q = rng.normal(size=(b, sq, c["heads"], c["head_dim"])).astype(np.float32)
    k = rng.normal(size=(b, skv, c["kv_heads"], c["head_dim"])).astype(np.float32)
    v = rng.normal(size=(b, skv, c["kv_heads"], c["head_dim"])).astype(np.float32)
    q_ids = kv_ids = None
    segment_ids = None
    if c["segments"]:
        kv_ids = np.sort(rng.integers(0, 3, size=(b, skv)), axis=1)
        q_ids = kv_ids[:, skv - sq :]
        segment_ids = (
            (jnp.asarray(q_ids), jnp.asarray(kv_ids)) if sq != skv else jnp.asarray(kv_ids)
        )
    kw = {k_: c[k_] for k_ in ("causal", "window", "softcap", "scale")}
    out = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segment_ids, impl=impl, **kw)
    ref = numpy_attention(q, k, v, q_ids=q_ids, kv_ids=kv_ids, **kw)
    # float32 logits/softmax over <= 12 keys of unit-normal data: errors ~1e-6.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=3)  # each example compiles a forward and two backward passes
@given(cases())
def test_xla_backward_matches_autodiff_of_the_reference(c):
    """The hand-written backward pass of impl="xla" against jax.grad of the plain reference
    (independent derivations), for a random cotangent."""
    _check_xla_backward(c)


@pytest.mark.slow
@settings(max_examples=20)
@given(cases())
def test_xla_backward_matches_autodiff_of_the_reference_broadly(c):
    _check_xla_backward(c)


def _check_xla_backward(c):
    rng = np.random.default_rng(c["seed"])
    b, sq, skv = c["batch"], c["q_len"], c["kv_len"]
    q = jnp.asarray(rng.normal(size=(b, sq, c["heads"], c["head_dim"])), jnp.float32)
    k, v = (
        jnp.asarray(rng.normal(size=(b, skv, c["kv_heads"], c["head_dim"])), jnp.float32)
        for _ in range(2)
    )
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    segment_ids = None
    if c["segments"]:
        kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, skv)), axis=1))
        segment_ids = (kv_ids[:, skv - sq :], kv_ids)
    kw = {k_: c[k_] for k_ in ("causal", "window", "softcap", "scale")}

    def grads(impl):
        return _attention_grads(q, k, v, segment_ids, cot, impl=impl, **kw)

    # float32 sums over <= 12 keys and <= 4 grouped heads: ~1e-6 relative; softcap's tanh'
    # and the rowsum(dO * O) form differ in rounding from autodiff's path.
    for mine, ref in zip(grads("xla"), grads("reference"), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_fully_masked_rows_are_zero_not_nan(impl):
    q = jnp.ones((1, 3, 2, 4))
    kv = jnp.ones((1, 3, 2, 4))
    seg = (jnp.array([[1, 2, 2]]), jnp.array([[2, 2, 2]]))
    out = ops.attention(q, kv, kv, causal=True, segment_ids=seg, impl=impl)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out[0, 0], 0.0)
    grads = jax.grad(
        lambda q, k, v: ops.attention(q, k, v, segment_ids=seg, impl=impl).sum(), argnums=(0, 1, 2)
    )(q, kv, kv)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_bf16_inputs_accumulate_in_float32(impl):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 16, 4, 8)).astype(np.float32) for _ in range(3))
    args = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    out = ops.attention(*args, causal=True, impl=impl)
    assert out.dtype == jnp.bfloat16
    ref = numpy_attention(
        q, k, v, causal=True, window=None, softcap=None, scale=None, q_ids=None, kv_ids=None
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)  # bf16 inputs: ~1e-2


def test_attention_errors_name_the_problem():
    q, kv = jnp.ones((1, 4, 3, 8)), jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 kv heads"):
        ops.attention(q, kv, kv)
    with pytest.raises(ValueError, match="unknown impl 'flash'"):
        ops.attention(kv, kv, kv, impl="flash")
    with pytest.raises(ValueError, match="window must be positive"):
        ops.attention(kv, kv, kv, window=0)
    with pytest.raises(ValueError, match=r"pass a \(q_ids, kv_ids\) pair"):
        ops.attention(kv[:, :2], kv, kv, segment_ids=jnp.ones((1, 4), jnp.int32))


def test_auto_dispatches_to_the_backends_kernel():
    """The native kernel on CPU (where it can be built), the Pallas kernel elsewhere."""
    q = jnp.ones((1, 8, 2, 8))
    jaxpr = str(jax.make_jaxpr(lambda q: ops.attention(q, q, q, causal=True))(q))
    on_native = jax.default_backend() == "cpu" and native.unavailable() is None
    assert ("edl_flash_attention_forward" if on_native else "pallas_call") in jaxpr
    pallas = jax.make_jaxpr(lambda q: ops.attention(q, q, q, causal=True, impl="pallas"))(q)
    assert "pallas_call" in str(pallas)


def test_auto_falls_back_with_one_warning_where_pallas_cannot_run(recwarn):
    """float64 inputs (no kernel dtype): auto warns once, then computes with impl="xla";
    an explicit impl="pallas" refuses with the same reason."""
    with jax.enable_x64(True):
        q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 4)))
        with pytest.warns(UserWarning, match="float32/bfloat16/float16 inputs, got float64"):
            out = ops.attention(q, q, q, causal=True)
        again = ops.attention(q, q, q, causal=True)
        assert not [w for w in recwarn if "edl attention" in str(w.message)]
        ref = ops.attention(q, q, q, causal=True, impl="reference")
        np.testing.assert_allclose(out, ref, rtol=1e-6)  # both: float32 logits
        np.testing.assert_array_equal(out, again)
        with pytest.raises(ValueError, match=r"impl='pallas' cannot run: .*float64"):
            ops.attention(q, q, q, impl="pallas")


def test_cudnn_needs_a_gpu_and_half_precision():
    """Without CUDA, or (on a GPU) with float32 inputs, a ValueError that says why."""
    kv = jnp.ones((1, 4, 2, 8))
    why = "bfloat16/float16 inputs, got float32" if jax.default_backend() == "gpu" else "CUDA"
    with pytest.raises(ValueError, match=rf"impl='cudnn' cannot run: .*{why}"):
        ops.attention(kv, kv, kv, impl="cudnn")
    with pytest.raises(ValueError, match=rf"impl='cudnn' cannot run: .*{why}"):
        jax.jit(functools.partial(ops.attention, impl="cudnn"))(kv, kv, kv)
