"""edl.kernels.paged_decode_attention (interpret mode on CPU) against float64 references.

The reference gathers each row's logical cache from the pool in numpy and runs explicit
float64 attention. Tolerances are relative to max(1, max |expected|): float32 accumulates
over at most a few hundred keys here (errors seen <1e-6, bound 1e-5); bfloat16 inputs are
compared on the same rounded inputs and the kernel rounds P to bfloat16 before ``P @ V``,
so the bound is a couple of units of bf16's 2^-8 resolution: 1e-2 (errors seen ~3e-3).
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl.kernels import decode_attention, paged_decode_attention
from edl.kernels.paged_attention import gather_pages

_paged = jax.jit(
    paged_decode_attention, static_argnames=("window", "softcap", "scale", "num_splits")
)


# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu
# On a GPU one page is one Triton key block: a power of two >= 16.
ON_GPU = jax.default_backend() == "gpu"


def _rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(1.0, np.abs(expected).max()))


def _numpy_paged(q, k_pages, v_pages, table, lengths, window, softcap, scale):
    """Float64 attention of each row's last new tokens over its gathered logical cache."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    batch, new, heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = np.zeros_like(q)
    for b in range(batch):
        used = -(-lengths[b] // page_size)
        k = k_pages[table[b, :used]].reshape(-1, kv_heads, head_dim)[: lengths[b]]
        v = v_pages[table[b, :used]].reshape(-1, kv_heads, head_dim)[: lengths[b]]
        keys = np.arange(lengths[b])
        for t in range(new):
            pos = lengths[b] - new + t
            seen = keys <= pos
            if window is not None:
                seen &= pos - keys < window
            if not seen.any():
                continue
            for h in range(heads):
                s = k[seen, h // group] @ q[b, t, h] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[b, t, h] = p @ v[seen, h // group] / p.sum()
    return out


def _pool(seed, batch, new, heads, kv_heads, head_dim, page_size, pages_per_seq, spare):
    """Random q and pool (numpy: no compiles), and a table drawn as a permutation of the pool,
    so rows' pages are scattered and interleaved."""
    num_pages = batch * pages_per_seq + spare
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, new, heads, head_dim), np.float32)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    return q, k, v, table.astype(np.int32)


@st.composite
def paged_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([16, 32] if ON_GPU else [1, 4, 16]))
    pages_per_seq = draw(st.integers(1, 4))
    capacity = page_size * pages_per_seq
    length = st.sampled_from([0, capacity]) | st.integers(0, capacity)
    return {
        "shape": {
            "batch": batch,
            "new": draw(st.integers(1, 3)),
            "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),  # MHA, GQA, MQA (kv 1)
            "kv_heads": kv_heads,
            "head_dim": draw(st.sampled_from([64, 128])),
            "page_size": page_size,
            "pages_per_seq": pages_per_seq,
            "spare": draw(st.integers(0, 3)),
        },
        "lengths": [draw(length) for _ in range(batch)],
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "num_splits": draw(st.sampled_from([None, 2])),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _check_paged(c):
    q, k, v, table = _pool(c["seed"], **c["shape"])
    q, k, v = (jnp.asarray(x.astype(c["dtype"])) for x in (q, k, v))
    lengths = jnp.asarray(c["lengths"], jnp.int32)
    out = _paged(
        q,
        k,
        v,
        table,
        lengths,
        window=c["window"],
        softcap=c["softcap"],
        num_splits=c["num_splits"],
    )
    expected = _numpy_paged(
        q,
        k,
        v,
        table,
        c["lengths"],
        c["window"],
        c["softcap"],
        c["shape"]["head_dim"] ** -0.5,
    )
    assert out.dtype == c["dtype"]
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, expected) < (1e-5 if c["dtype"] == jnp.float32 else 1e-2)


@settings(max_examples=10)  # every example compiles a kernel for new shapes; broadly: slow
@given(paged_cases())
def test_paged_decode_attention_matches_float64(c):
    _check_paged(c)


@pytest.mark.slow
@settings(max_examples=40)
@given(paged_cases())
def test_paged_decode_attention_matches_float64_broadly(c):
    _check_paged(c)


@pytest.mark.parametrize(
    ("page_size", "kw"),
    [(16, {}), (4, {"window": 7, "softcap": 20.0}), (8, {"scale": 0.3})],
)
def test_paged_equals_decode_attention_on_the_gathered_cache(page_size, kw):
    page_size = 16 * page_size if ON_GPU else page_size
    q, k, v, table = _pool(1, 3, 2, 8, 2, 64, page_size, 6, 5)
    lengths = np.array([0, 3 * page_size - 1, 6 * page_size], np.int32)
    out = _paged(q, k, v, table, lengths, **kw)

    @jax.jit
    def gathered(q, k, v, table, lengths):
        return decode_attention(q, gather_pages(k, table), gather_pages(v, table), lengths, **kw)

    np.testing.assert_allclose(out, gathered(q, k, v, table, lengths), atol=2e-6)
    assert not np.asarray(out[0]).any()  # length 0: zeros


def test_unused_table_entries_and_pages_are_never_read():
    """Garbage in unused table entries (-1, past the pool) and NaN in every page no row
    uses and in the unused tail of each row's last page change nothing."""
    page_size, pages_per_seq = (64 if ON_GPU else 4), 5
    q, k, v, table = _pool(2, 3, 2, 4, 2, 64, page_size, pages_per_seq, 4)
    lengths = np.array([5, 13, 20], np.int32) * page_size // 4
    clean = _paged(q, k, v, table, lengths, window=9)

    used = -(-lengths // page_size)
    unused = np.arange(pages_per_seq)[None, :] >= used[:, None]
    garbage = np.where(np.arange(pages_per_seq) % 2, -1, k.shape[0] + 5)[None, :]
    bad_table = np.where(unused, garbage, table).astype(np.int32)
    live = np.zeros(k.shape[:2], bool)
    for b, n in enumerate(lengths):
        for pos in range(n):
            live[table[b, pos // page_size], pos % page_size] = True
    nan_k, nan_v = (np.where(live[:, :, None, None], x, np.float32(np.nan)) for x in (k, v))
    assert np.isnan(nan_k[table[0, 1], lengths[0] - page_size :]).all()  # row 0's last page
    out = _paged(q, nan_k, nan_v, bad_table, lengths, window=9)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, clean)


def test_paged_decode_attention_errors_name_the_problem():
    q = jnp.zeros((2, 1, 4, 64))
    pool = jnp.zeros((10, 16, 2, 64))
    table, lengths = jnp.zeros((2, 3), jnp.int32), jnp.array([1, 2])
    with pytest.raises(ValueError, match=r"lengths must be of shape \(2,\), got \(3,\)"):
        paged_decode_attention(q, pool, pool, table, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"page_table must be of shape \(2, pages_per_seq\)"):
        paged_decode_attention(q, pool, pool, jnp.zeros((3, 3), jnp.int32), lengths)
    pool3 = jnp.zeros((10, 16, 3, 64))
    with pytest.raises(ValueError, match="heads must be a multiple of the 3 kv heads"):
        paged_decode_attention(q, pool3, pool3, table, lengths)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        paged_decode_attention(q, pool.astype(jnp.bfloat16), pool, table, lengths)
    # Under the test suite's jaxtyping hook the annotation names the argument first.
    with pytest.raises((ValueError, TypeError), match="v_pages"):
        paged_decode_attention(q, pool, jnp.zeros((11, 16, 2, 64)), table, lengths)
    for page_size in (8, 24):
        small = jnp.zeros((10, page_size, 2, 64))
        with pytest.raises(ValueError, match=f"power of two >= 16, got {page_size}"):
            paged_decode_attention(q, small, small, table, lengths, interpret=False)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "group", "page_size", "kw"),
    [
        (128, jnp.bfloat16, 4, 16, {"window": 128}),
        (64, jnp.float16, 1, 32, {"softcap": 30.0, "num_splits": 3}),
        (80, jnp.float32, 3, 16, {}),  # head_dim padded to 128 for Triton
    ],
)
def test_paged_decode_attention_lowers_to_triton(head_dim, dtype, group, page_size, kw):
    def run(q, k, v, table, lengths):
        return paged_decode_attention(q, k, v, table, lengths, interpret=False, **kw)

    q = jax.ShapeDtypeStruct((2, 2, 3 * group, head_dim), dtype)
    pool = jax.ShapeDtypeStruct((157, page_size, 3, head_dim), dtype)
    table = jax.ShapeDtypeStruct((2, 10), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    lowered = jax.jit(run).trace(q, pool, pool, table, lengths)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
