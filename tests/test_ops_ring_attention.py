"""edl.ops.ring_attention on the 8 forced host devices against float64 references: the
forward against ``numpy_attention`` (test_ops_attention's, position arithmetic), the
gradients in float64 against autodiff of a plain jnp float64 attention. Tolerances: float32
over at most 64 keys accumulates ~1e-6 relative error (bound 2e-5, as the kernels'); the
float64 gradients agree to ~1e-12 (bound 1e-9)."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_ops_attention import numpy_attention

from edl.ops.ring_attention import ring_attention, zigzag_order
from edl.sharding import make_mesh

MESHES = {"sp8": (1, 1, 1, 8), "dp2 sp4": (2, 1, 1, 4), "tp2 sp4": (1, 1, 2, 4)}


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    return {
        "mesh": draw(st.sampled_from(sorted(MESHES))),
        "blocks": draw(st.sampled_from([1, 2, 3])),  # tokens per device: 2 * blocks
        "heads": kv_heads * draw(st.sampled_from([1, 2])),
        "kv_heads": kv_heads,
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 20)),
        "segments": draw(st.booleans()),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "zigzag": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _inputs(c, dtype=np.float32):
    shards = MESHES[c["mesh"]][3]
    seq, d = 2 * shards * c["blocks"], 8
    rng = np.random.default_rng(c["seed"])
    q = rng.normal(size=(2, seq, c["heads"], d)).astype(dtype)
    k = rng.normal(size=(2, seq, c["kv_heads"], d)).astype(dtype)
    v = rng.normal(size=(2, seq, c["kv_heads"], d)).astype(dtype)
    ids = np.sort(rng.integers(0, 3, (2, seq)), axis=1) if c["segments"] else None
    order = zigzag_order(seq, shards) if c["zigzag"] else np.arange(seq)
    return q, k, v, ids, order


def _ring(c, q, k, v, ids, order):
    """Ring attention over the tokens in ``order``, the output put back in sequence order."""
    take = lambda x: None if x is None else jnp.asarray(x[:, order])
    with jax.set_mesh(make_mesh(MESHES[c["mesh"]])):
        out = jax.jit(
            lambda q, k, v, ids: ring_attention(
                q,
                k,
                v,
                causal=c["causal"],
                window=c["window"],
                segment_ids=ids,
                positions=jnp.asarray(order, jnp.int32),
                softcap=c["softcap"],
            )
        )(take(q), take(k), take(v), take(ids))
    return np.asarray(out)[:, np.argsort(order)]


@settings(max_examples=4, deadline=None)  # ~1.5 s an example; broadly: the gradient test (slow)
@given(cases())
def test_ring_attention_matches_float64(c):
    q, k, v, ids, order = _inputs(c)
    out = _ring(c, q, k, v, ids, order)
    want = numpy_attention(
        q,
        k,
        v,
        causal=c["causal"],
        window=c["window"],
        softcap=c["softcap"],
        scale=None,
        q_ids=ids,
        kv_ids=ids,
    )
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(out - want).max() / scale < 2e-5


def _plain(q, k, v, ids, *, causal, window, softcap):
    """float64 attention in plain jnp (differentiable), positions in order."""
    seq, groups = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    pos = jnp.arange(seq)
    visible = jnp.ones((seq, seq), bool)
    if causal or window is not None:
        visible &= pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[:, None] - pos[None, :] < window
    visible = visible[None] & (ids[:, :, None] == ids[:, None, :])
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(total == 0, 1.0, total)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.slow  # ~4 s an example (test_sharding's ring train steps check gradients by default)
@settings(max_examples=6, deadline=None)
@given(cases())
def test_ring_attention_gradients_match_float64_autodiff(c):
    with jax.enable_x64(True):
        q, k, v, ids, order = _inputs(c, np.float64)
        ids = np.zeros((2, q.shape[1]), np.int64) if ids is None else ids
        cotangent = np.random.default_rng(1).normal(size=q.shape)
        flags = {k: c[k] for k in ("causal", "window", "softcap")}

        def ring_loss(q, k, v):
            out = ring_attention(
                q,
                k,
                v,
                segment_ids=jnp.asarray(ids[:, order]),
                positions=jnp.asarray(order, jnp.int32),
                **flags,
            )
            return jnp.sum(out * cotangent[:, order])

        def plain_loss(q, k, v):
            return jnp.sum(_plain(q, k, v, jnp.asarray(ids), **flags) * cotangent)

        with jax.set_mesh(make_mesh(MESHES[c["mesh"]])):
            got = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(
                *(jnp.asarray(x[:, order]) for x in (q, k, v))
            )
        want = jax.grad(plain_loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (q, k, v)))
        for name, g, w in zip("qkv", got, want, strict=True):
            g = np.asarray(g)[:, np.argsort(order)]
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, np.asarray(w), atol=1e-9, err_msg=name)


def test_zigzag_order_balances_causal_work():
    """Each device's visible (query, key) pairs are equal under the zig-zag order, and the
    order is a permutation."""
    seq, shards = 32, 4
    order = zigzag_order(seq, shards)
    assert sorted(order) == list(range(seq))
    work = [
        sum(int(q >= k) for q in block for k in range(seq)) for block in order.reshape(shards, -1)
    ]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* shards"):
        zigzag_order(30, 4)


def test_ring_attention_names_a_missing_axis_or_bad_length():
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="needs a mesh with axis 'sp'"):
        ring_attention(q, q, q)
    mesh = make_mesh((1, 1, 1, 8))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="divisible by the 8 devices"):
        ring_attention(q[:, :6], q[:, :6], q[:, :6])
