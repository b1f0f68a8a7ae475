"""edl.ops.attention against an independent float64 numpy reference."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from edl import ops


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


@given(cases())
def test_attention_matches_float64_reference(c):
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
    out = ops.attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segment_ids=segment_ids, **kw
    )
    ref = numpy_attention(q, k, v, q_ids=q_ids, kv_ids=kv_ids, **kw)
    # float32 logits/softmax over <= 12 keys of unit-normal data: errors ~1e-6.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
    q = jnp.ones((1, 3, 2, 4))
    kv = jnp.ones((1, 3, 2, 4))
    seg = (jnp.array([[1, 2, 2]]), jnp.array([[2, 2, 2]]))
    out = ops.attention(q, kv, kv, causal=True, segment_ids=seg)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out[0, 0], 0.0)
    grads = jax.grad(lambda q: ops.attention(q, kv, kv, segment_ids=seg).sum())(q)
    assert np.isfinite(np.asarray(grads)).all()


def test_bf16_inputs_accumulate_in_float32():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 16, 4, 8)).astype(np.float32) for _ in range(3))
    out = ops.attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), causal=True)
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
