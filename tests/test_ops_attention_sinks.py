"""Attention sinks (GPT-OSS): learned per-head logits in the softmax denominator.

The forward of every impl against a float64 numpy evaluation of transformers' definition
(the sink appended as one more logit, dropped after the softmax); the hand-written backward
of ``impl="xla"`` (the sink's gradient ``-sum_q exp(sink - lse_q) * D_q``) against jax
autodiff of the plain reference, in float64.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl import ops


def numpy_sink_attention(q, k, v, sinks, *, causal, window):
    """float64, as transformers' gpt_oss ``eager_attention_forward``: the sink column joins
    the softmax and is dropped after it."""
    q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    k, v = (np.repeat(x, h // hkv, axis=2) for x in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    qpos = np.arange(sq)[:, None] + skv - sq
    kpos = np.arange(skv)[None]
    allowed = np.ones((sq, skv), bool)
    if causal or window is not None:
        allowed &= kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    logits = np.where(allowed, logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(sinks[None, :, None, None], (b, h, sq, 1))], -1)
    full = full - full.max(-1, keepdims=True)
    p = np.exp(full)
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    kv_len = draw(st.integers(1, 10))
    return {
        "batch": draw(st.integers(1, 2)),
        "q_len": draw(st.integers(1, kv_len)),
        "kv_len": kv_len,
        "heads": kv_heads * draw(st.sampled_from([1, 2])),
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8])),
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 5)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _inputs(c, dtype=np.float32):
    rng = np.random.default_rng(c["seed"])
    b, sq, skv, d = c["batch"], c["q_len"], c["kv_len"], c["head_dim"]
    q = rng.normal(size=(b, sq, c["heads"], d))
    k, v = (rng.normal(size=(b, skv, c["kv_heads"], d)) for _ in range(2))
    sinks = 2.0 * rng.normal(size=(c["heads"],))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, sinks))


@functools.partial(jax.jit, static_argnames=("causal", "window", "impl"))
def _attention(q, k, v, sinks, *, causal, window, impl):
    return ops.attention(q, k, v, causal=causal, window=window, sinks=sinks, impl=impl)


@pytest.mark.gpu  # "auto": the Triton kernel with sinks on a GPU
@pytest.mark.parametrize("impl", ["reference", "xla", "auto"])
@settings(max_examples=8, deadline=None)  # each example compiles new shapes
@given(cases())
def test_sinks_forward_matches_float64_transformers_definition(impl, c):
    q, k, v, sinks = _inputs(c)
    kw = {"causal": c["causal"], "window": c["window"]}
    out = _attention(q, k, v, sinks, impl=impl, **kw)
    ref = numpy_sink_attention(q, k, v, sinks, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=6, deadline=None)  # each example compiles two backward passes
@given(cases())
def test_xla_sink_backward_matches_float64_autodiff_of_the_reference(c):
    """dq, dk, dv and d sinks of the hand-written backward against jax.grad of the plain
    reference, both in float64, for a random cotangent."""
    with jax.enable_x64(True):
        q, k, v, sinks = _inputs(c, np.float64)
        cot = jnp.asarray(np.random.default_rng(c["seed"] + 1).normal(size=q.shape))

        def grads(impl):
            def f(q, k, v, sinks):
                out = ops.attention(
                    q, k, v, causal=c["causal"], window=c["window"], sinks=sinks, impl=impl
                )
                return jnp.sum(out * cot)

            return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

        for name, mine, ref in zip(
            ("q", "k", "v", "sinks"), grads("xla"), grads("reference"), strict=True
        ):
            np.testing.assert_allclose(mine, ref, rtol=1e-9, atol=1e-9, err_msg=name)


def test_sinks_shrink_the_weights_and_change_the_output():
    """A very negative sink is no sink; a large one takes the whole row (output -> 0)."""
    c = {"batch": 1, "q_len": 3, "kv_len": 3, "heads": 2, "kv_heads": 1, "head_dim": 4}
    q, k, v, _ = _inputs({**c, "seed": 0})
    plain = ops.attention(q, k, v, causal=True, impl="xla")
    none = ops.attention(q, k, v, causal=True, sinks=jnp.full((2,), -1e4), impl="xla")
    np.testing.assert_allclose(none, plain, rtol=1e-6, atol=1e-6)
    full = ops.attention(q, k, v, causal=True, sinks=jnp.full((2,), 1e4), impl="xla")
    np.testing.assert_allclose(full, 0.0, atol=1e-6)


def test_sinks_must_be_one_per_query_head():
    q = jnp.zeros((1, 2, 4, 8))
    k = jnp.zeros((1, 2, 2, 8))
    # jaxtyping (on in the tests) or the op's own check names the argument
    with pytest.raises((ValueError, TypeError), match=r"parameter 'sinks'|sinks must be \(4,\)"):
        ops.attention(q, k, k, sinks=jnp.zeros((2,)))


def test_kernels_without_sinks_say_so():
    """The kernels without sinks decline them, naming why ("auto" then computes with XLA and
    warns once with that reason)."""
    import importlib

    attention_module = importlib.import_module("edl.ops.attention")

    q, k, v, sinks = _inputs(
        {"batch": 1, "q_len": 2, "kv_len": 2, "heads": 2, "kv_heads": 1, "head_dim": 4, "seed": 1}
    )
    opts = attention_module._Options(causal=True, window=None, softcap=None, scale=None)
    reason = attention_module._cudnn_unsupported(opts, q, k, v, None, None, sinks)
    assert reason is not None  # no sinks (or no CUDA here at all)
    assert attention_module._tpu_unsupported(opts, q, k, v, None, None, sinks) is None
    reason = attention_module._native_unsupported(opts, q, k, v, None, None, sinks)
    assert reason is not None  # no sinks (or no native kernel here at all)
