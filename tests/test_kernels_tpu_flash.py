"""edl.kernels.tpu.flash_attention (Mosaic) in TPU interpret mode on CPU, against float64.

Outputs and dq/dk/dv are compared with the float64 numpy oracle of test_kernels_attention
(``_float64_reference``, itself checked there against autodiff of ``reference_attention``),
run in Pallas' TPU interpret mode (``pltpu.InterpretParams()``: TPU memory spaces, DMAs and
the grid's pipelining simulated). Tolerances as in that file, relative to
max(1, max |expected|): float32 kernels accumulate in float32 over at most ~700 keys here,
errors ~1e-6, so 2e-5 leaves a ~10x margin; bfloat16 is compared on the same rounded inputs
and the kernel rounds P to bfloat16 before ``P @ V``, a few units of 2^-8: 3e-2.

No TPU runs here: that the kernels compile for one is checked by lowering them for TPU from
this host (Pallas emits the Mosaic module; Mosaic's own compiler only runs on a TPU). The
interpreter is slow (one simulated grid step costs milliseconds), so shapes and example
counts are small; broader sweeps are marked slow.
"""

import functools
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental.pallas import tpu as pltpu
from test_kernels_attention import _float64_reference, _inputs, _rel_err, _segments

from edl.kernels.tpu import _flash_kernels as kernels
from edl.kernels.tpu.flash_attention import BlockSizes, _tiles, flash_attention

SMALL = BlockSizes(128, 128, 128, 128)
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}


def _kernel(q, k, v, d_out, *, segment_ids=None, interpret=None, **kw):
    """The kernel's output and (dq, dk, dv) for cotangent ``d_out``, as one compiled program."""
    interpret = pltpu.InterpretParams() if interpret is None else interpret

    @jax.jit
    def run(q, k, v, d_out, segment_ids):
        q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
        fn = functools.partial(
            flash_attention, q_segment_ids=q_ids, kv_segment_ids=kv_ids, interpret=interpret, **kw
        )
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return run(q, k, v, d_out, segment_ids)


def _assert_close(q, k, v, d_out, segment_ids=None, block_sizes=SMALL, interpret=None, **kw):
    out, grads = _kernel(
        q, k, v, d_out, segment_ids=segment_ids, block_sizes=block_sizes, interpret=interpret, **kw
    )
    ref_out, ref_grads = _float64_reference(q, k, v, d_out, segment_ids=segment_ids, **kw)
    tol = TOL[q.dtype]
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert actual.dtype == q.dtype, name
        assert not bool(jnp.isnan(actual).any()), name
        err = _rel_err(actual, expected)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} ({kw})"
    return out, grads


@st.composite
def tpu_flash_cases(draw, max_len=300):
    kv_heads = draw(st.sampled_from([1, 2]))
    q_len = draw(st.integers(1, max_len))
    return {
        "batch": draw(st.integers(1, 2)),
        "q_len": q_len,
        "kv_len": q_len if draw(st.booleans()) else draw(st.integers(q_len, max_len)),
        "heads": kv_heads * draw(st.sampled_from([1, 2, 3])),
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([8, 64])),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 200)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "scale": draw(st.none() | st.floats(0.1, 1.0)),
        # Ids from {0, 1, 2} (shifted to {-1, 0, 1}): some queries see no key.
        "segments": draw(st.sampled_from([None, 0, -1])),
        # Tiles of 128 or 256 (unequal ones pad to whole tiles of both), or the defaults.
        "blocks": draw(st.none() | st.builds(BlockSizes, *[st.sampled_from([128, 256])] * 4)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _check_case(c):
    shape = [c[k] for k in ("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim")]
    q, k, v, d_out = _inputs(c["seed"], *shape, c["dtype"])
    segments = None
    if c["segments"] is not None:
        q_ids, kv_ids = _segments(c["seed"], c["batch"], c["q_len"], c["kv_len"])
        segments = (q_ids + c["segments"], kv_ids + c["segments"])
    _assert_close(
        q,
        k,
        v,
        d_out,
        segments,
        c["blocks"],
        causal=c["causal"],
        window=c["window"],
        softcap=c["softcap"],
        scale=c["scale"],
    )


@settings(max_examples=2)  # each compiles three kernels and interprets ~100 steps; broadly: slow
@given(tpu_flash_cases())
def test_tpu_flash_attention_matches_float64(c):
    _check_case(c)


@pytest.mark.slow
@settings(max_examples=60)
@given(tpu_flash_cases(max_len=700))
def test_tpu_flash_attention_matches_float64_broadly(c):
    _check_case(c)


def test_rows_that_see_no_key_are_zero_with_zero_gradients():
    """Queries before the first key (q_len > kv_len, causal), a query id no key has (5), and
    keys no query sees (id 7): zero output, zero gradients, no NaN, across several blocks."""
    q, k, v, d_out = _inputs(2, 1, 300, 260, 4, 2, 32)
    q_ids = np.zeros((1, 300), np.int32)
    q_ids[0, 100:140] = 5
    q_ids[0, 200:] = -1
    kv_ids = np.zeros((1, 260), np.int32)
    kv_ids[0, 150:] = -1
    kv_ids[0, 10:30] = 7
    segments = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    out, (dq, dk, dv) = _assert_close(q, k, v, d_out, segments, causal=True)
    for rows in (slice(0, 40), slice(100, 140)):  # 40 queries before key 0; id 5
        np.testing.assert_array_equal(out[0, rows], 0.0)
        np.testing.assert_array_equal(dq[0, rows], 0.0)
    np.testing.assert_array_equal(dk[0, 10:30], 0.0)
    np.testing.assert_array_equal(dv[0, 10:30], 0.0)
    assert bool(jnp.all(jnp.any(out[0, 40:100] != 0, axis=(-1, -2))))


def test_sliding_window_over_long_keys_skips_hidden_blocks_correctly():
    """q_len < kv_len with a window: each query block sees 3-4 of 8 K/V blocks, and K/V
    blocks 0-2 are seen by none. The window (190, offset 700) puts the first key of query
    block 0 (key 511) last in K/V block 3 and the last query of key block 4 first in query
    block 1, so a skip range off by one position drops a visible block and breaks the match."""
    q, k, v, d_out = _inputs(4, 1, 300, 1000, 4, 2, 32)
    _assert_close(q, k, v, d_out, window=190, softcap=4.0)


def test_plain_interpret_mode_matches_float64():
    q, k, v, d_out = _inputs(5, 2, 150, 200, 2, 1, 16)
    _assert_close(q, k, v, d_out, interpret=True, causal=True, window=90)


def _plan(q_len, kv_len, causal, window, bq=128, bk=128):
    return kernels.Plan(
        causal=causal or window is not None,
        window=window,
        softcap=None,
        scale=1.0,
        q_len=q_len,
        kv_len=kv_len,
        padded_q=-(-q_len // bq) * bq,
        padded_kv=-(-kv_len // bk) * bk,
        block_q=bq,
        block_k=bk,
        block_q_bwd=bq,
        block_k_bwd=bk,
        interpret=False,
    )


def _blocks_seen(plan, bq, bk):
    """``(query blocks, K/V blocks)`` bool array: some (padded) query of the block sees some
    real key of the K/V block (real queries only for the dk/dv direction, below)."""
    q_pos = np.arange(plan.padded_q)[:, None] + plan.offset
    k_pos = np.arange(plan.padded_kv)[None, :]
    seen = np.broadcast_to(k_pos < plan.kv_len, (plan.padded_q, plan.padded_kv))
    if plan.causal:
        seen = seen & (k_pos <= q_pos)
    if plan.window is not None:
        seen = seen & (q_pos - k_pos < plan.window)
    return seen.reshape(plan.padded_q // bq, bq, -1, bk).any(axis=(1, 3))


def _fetches(indices) -> int:
    """DMAs the pipeline issues along one sweep: one per change of block index."""
    return 1 + sum(a != b for a, b in itertools.pairwise(indices))


@pytest.mark.parametrize(
    ("q_len", "kv_len", "causal", "window"),
    [
        (300, 300, True, None),
        (300, 1000, True, 130),
        (1000, 300, True, None),
        (200, 700, False, None),
        (640, 640, True, 1),
        (256, 1024, True, 300),
    ],
)
def test_skipped_blocks_are_exactly_the_hidden_ones_and_cost_no_dma(q_len, kv_len, causal, window):
    """The index-map/``pl.when`` ranges against brute-force visibility: every visible block
    is visited, no hidden one is, and clamped indices repeat so only visible blocks are
    fetched (one fetch along a sweep with nothing visible)."""
    bq = bk = 128
    plan = _plan(q_len, kv_len, causal, window, bq, bk)
    seen = _blocks_seen(plan, bq, bk)
    nq, nk = seen.shape
    for i in range(nq):  # forward / dq: K/V blocks of query block i
        lo, hi = (int(x) for x in kernels.kv_range(plan, jnp.int32(i), bq, bk))
        assert set(range(lo, hi)) == set(np.flatnonzero(seen[i])), i
        idx = [int(kernels.clamp_block(jnp.int32(j), lo, hi, nk)) for j in range(nk)]
        assert all(idx[j] == j for j in range(lo, hi))
        assert _fetches(idx) == max(1, hi - lo)
    real_q = -(-q_len // bq)  # dk/dv: blocks of real queries only (padded rows have dO = 0)
    for j in range(nk):
        lo, hi = (int(x) for x in kernels.q_range(plan, jnp.int32(j), bq, bk))
        assert set(range(lo, hi)) == set(np.flatnonzero(seen[:real_q, j])), j
        idx = [int(kernels.clamp_block(jnp.int32(i), lo, hi, nq)) for i in range(nq)]
        assert _fetches(idx) == max(1, hi - lo)


def test_tiles_pad_short_sequences_little():
    assert _tiles(256, 256, 300) == (256, 256, 512)
    assert _tiles(512, 256, 300) == (512, 256, 512)  # not lcm(384, 256) = 768
    assert _tiles(512, 384, 300) == (384, 384, 384)
    assert _tiles(128, 128, 1) == (128, 128, 128)
    assert _tiles(512, 256, 1000) == (512, 256, 1024)


def _lower_for_tpu(fn, *shapes) -> str:
    """Lower ``fn`` for TPU from this CPU-only machine: Pallas emits the Mosaic kernels."""
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize(
    ("head_dim", "dtype", "group", "q_len", "kv_len", "segments", "kw"),
    [
        (128, jnp.bfloat16, 4, 1000, 1000, True, {"causal": True, "window": 256, "softcap": 30.0}),
        (64, jnp.float32, 1, 300, 300, False, {}),
        (80, jnp.float32, 2, 100, 700, False, {"causal": True}),  # head_dim: a full-dim block
        (256, jnp.bfloat16, 2, 2048, 4096, True, {"causal": True, "scale": 0.1}),
    ],
)
def test_tpu_flash_attention_lowers_for_tpu(head_dim, dtype, group, q_len, kv_len, segments, kw):
    def loss(q, k, v, q_ids, kv_ids):
        if not segments:
            q_ids = kv_ids = None
        out = flash_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, q_len, 2 * group, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), dtype)
    ids = (
        jax.ShapeDtypeStruct((2, q_len), jnp.int32),
        jax.ShapeDtypeStruct((2, kv_len), jnp.int32),
    )
    assert _lower_for_tpu(loss, q, kv, kv, *ids).count("tpu_custom_call") == 1  # forward
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _lower_for_tpu(grad, q, kv, kv, *ids).count("tpu_custom_call") == 3  # fwd, dq, dk/dv


def test_tpu_flash_attention_errors_name_the_problem():
    q = jnp.zeros((1, 4, 4, 8))
    kv3 = jnp.zeros((1, 4, 3, 8))
    with pytest.raises(ValueError, match="4 heads not a multiple of 3 kv heads"):
        flash_attention(q, kv3, kv3)
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
        flash_attention(q, q, q, q_segment_ids=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="empty sequence"):
        flash_attention(q, q[:, :0], q[:, :0])
    with pytest.raises(ValueError, match="window must be positive, got 0"):
        flash_attention(q, q, q, window=0)
    half = q.astype(jnp.float16)
    with pytest.raises(TypeError, match="float32/bfloat16, got float16/float16/float16"):
        flash_attention(half, half, half)
    with pytest.raises(TypeError, match="got float32/bfloat16/float32"):
        flash_attention(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(ValueError, match=r"BlockSizes.block_k must be a positive multiple of 128"):
        BlockSizes(block_k=100)
