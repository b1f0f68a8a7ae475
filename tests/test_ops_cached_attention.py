"""edl.ops.cached_attention's XLA paths against float64 (tests/test_kernels_attention.py has
the reference and checks the Pallas kernel the same way).

Tolerances are relative to max(1, max |expected|): float32 accumulates over at most 64 keys
here (errors seen ~1e-7, bound 2e-5, as for the kernel); bfloat16 inputs are compared on the
same rounded inputs, and the probabilities are rounded to bfloat16 before ``P @ V``, so the
bound is a couple of units of bf16's 2^-8 resolution: 1e-2.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_kernels_attention import _inputs, _numpy_decode, _rel_err

from edl.ops.cached_attention import (
    _one_token_attention,
    cache_mask,
    cached_attention,
    paged_attention,
)

_cached = jax.jit(cached_attention, static_argnames=("window", "softcap", "scale", "impl"))


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    cache_len = draw(st.sampled_from([8, 24, 64]))
    new = draw(st.sampled_from([1, 1, 2, 3]))  # one new token: the decode step's own path
    batch = draw(st.integers(1, 4))
    return {
        "batch": batch,
        "new": new,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 3])),
        "kv_heads": kv_heads,
        "cache_len": cache_len,
        "lengths": [draw(st.integers(new, cache_len)) for _ in range(batch)],
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "head_dim": draw(st.sampled_from([4, 8])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=12, deadline=None)
@given(cases(), st.sampled_from(["xla", "auto", "reference"]))
def test_cached_attention_matches_float64(c, impl):
    d = c["head_dim"]
    q, k, v, _ = _inputs(
        c["seed"], c["batch"], c["new"], c["cache_len"], c["heads"], c["kv_heads"], d
    )
    lengths = jnp.asarray(c["lengths"], jnp.int32)
    out = _cached(q, k, v, lengths, window=c["window"], softcap=c["softcap"], impl=impl)
    expected = _numpy_decode(
        q, k, v, c["lengths"], [0] * c["batch"], c["window"], c["softcap"], d**-0.5
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_err(out, expected) < 2e-5


@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)])
def test_one_token_attention_matches_float64(dtype, tol):
    """The CPU decode form called directly (whatever the backend), GQA groups of 3."""
    q, k, v, _ = _inputs(7, 5, 1, 40, 6, 2, 16, dtype)
    lengths = [1, 9, 17, 33, 40]
    mask = cache_mask(1, 40, jnp.asarray(lengths), window=20)
    out = jax.jit(_one_token_attention, static_argnames=("softcap", "scale"))(
        q, k, v, mask, softcap=3.0, scale=0.3
    )
    expected = _numpy_decode(q, k, v, lengths, [0] * 5, 20, 3.0, 0.3)
    assert out.dtype == dtype
    assert _rel_err(out, expected) < tol


def test_decode_step_reads_the_cache_in_place_on_cpu():
    """On CPU one new token takes the block-diagonal form (no (batch, kv_heads, len, dim) copy
    of the cache), several new tokens the grouped einsum; "auto" means "xla" there."""
    q, k, v, _ = _inputs(0, 2, 1, 32, 8, 4, 16)
    lengths = jnp.asarray([5, 32], jnp.int32)

    def hlo(q, impl):
        return _cached.lower(q, k, v, lengths, impl=impl).compile().as_text()

    one_token = hlo(q, "xla")
    assert "f32[2,32,8]" in one_token  # logits (batch, len, heads) from one dot per row
    assert "f32[2,4,32,16]" not in one_token  # the transposed cache of the grouped einsum
    assert "f32[2,4,32,16]" in hlo(q, "reference")

    def jaxpr(impl):
        return str(jax.make_jaxpr(functools.partial(cached_attention, impl=impl))(q, k, v, lengths))

    assert jaxpr("auto") == jaxpr("xla")
    assert "edl_decode_attention" not in jaxpr("auto")
    assert "edl_decode_attention" in jaxpr("pallas")
    q3 = jnp.concatenate([q, q, q], axis=1)
    assert "f32[2,4,32,16]" in hlo(q3, "xla")


def test_paged_attention_xla_equals_contiguous():
    """The paged path's XLA impl gathers pages and shares the contiguous decode form."""
    q, k, v, _ = _inputs(3, 2, 1, 32, 4, 2, 8)
    pages = jnp.concatenate([k.reshape(8, 8, 2, 8), v.reshape(8, 8, 2, 8)])  # 16 pages
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    lengths = jnp.asarray([11, 30], jnp.int32)
    out = paged_attention(q, pages[:8], pages[8:], table, lengths, impl="xla")
    expected = cached_attention(q, k, v, lengths, impl="reference")
    np.testing.assert_allclose(out, expected, atol=2e-6)
