"""edl.kernels.tpu decode and paged decode attention against float64 references, run in
Pallas' TPU interpret mode on CPU (``pltpu.InterpretParams()``: TPU memory spaces and DMAs
simulated, out-of-bounds reads raise), and lowered for TPU from this host.

The references are the explicit float64 numpy loops of ``test_kernels_attention`` and
``test_kernels_paged``, fed clean inputs while the kernel gets the same inputs with NaN
wherever nothing may be read (cache positions at or past a row's length or before its
``kv_start``, a page's unused tail, unused pages, other layers) and garbage (-1, past the
pool) in unused table entries: any leak shows as NaN or a mismatch. Tolerances are relative
to max(1, max |expected|): float32 accumulates over at most ~100 keys (errors seen <2e-7,
bound 1e-5); bfloat16 inputs are compared on the same rounded inputs, and the kernel rounds
P to bfloat16 before ``P @ V`` and the output to bfloat16, each ~2^-9 relative, so the bound
is a few units of bfloat16's resolution: 3e-2 (errors seen <3e-3).

Interpret mode compiles a program per shape and option set (~1-2 s each on CPU), so shapes
are tiny and example counts small; ``-m slow`` runs broader searches.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental.pallas import tpu as pltpu
from test_kernels_attention import _numpy_decode, _rel_err
from test_kernels_paged import _numpy_paged, _pool

from edl.kernels.tpu._decode_common import Plan, check_sinks
from edl.kernels.tpu.decode_attention import _cache_block, decode_attention
from edl.kernels.tpu.paged_attention import _page_spec, paged_decode_attention

INTERPRET = pltpu.InterpretParams()
_decode = jax.jit(
    functools.partial(decode_attention, interpret=INTERPRET),
    static_argnames=("window", "softcap", "scale", "block_k"),
)
_paged = jax.jit(
    functools.partial(paged_decode_attention, interpret=INTERPRET),
    static_argnames=("window", "softcap", "scale", "pages_per_block"),
)


def _tolerance(dtype) -> float:
    return 1e-5 if dtype == jnp.float32 else 3e-2


def _assert_matches(out, expected, dtype):
    assert out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    err = _rel_err(out, expected)
    assert err < _tolerance(dtype), f"relative error {err:.2e}"


@st.composite
def decode_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    cache_len = draw(st.sampled_from([16, 24, 40]))
    batch = draw(st.integers(1, 3))
    lengths = [
        draw(st.sampled_from([0, cache_len]) | st.integers(0, cache_len)) for _ in range(batch)
    ]
    return {
        "batch": batch,
        "new": draw(st.integers(1, 4)),
        "heads": kv_heads * draw(st.sampled_from([1, 2, 3])),  # MHA, GQA (MQA: kv 1)
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([16, 64])),
        "cache_len": cache_len,
        "lengths": lengths,
        "kv_start": [draw(st.integers(0, n)) for n in lengths] if draw(st.booleans()) else None,
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "block_k": draw(st.sampled_from([None, 4, 8, 16])),  # lengths rarely a multiple
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _check_decode(c):
    rng = np.random.default_rng(c["seed"])
    q_shape = (c["batch"], c["new"], c["heads"], c["head_dim"])
    kv_shape = (c["batch"], c["cache_len"], c["kv_heads"], c["head_dim"])
    q, k, v = (
        np.asarray(jnp.asarray(rng.standard_normal(s, np.float32)).astype(c["dtype"]), np.float32)
        for s in (q_shape, kv_shape, kv_shape)
    )
    starts = c["kv_start"] or [0] * c["batch"]
    pos = np.arange(c["cache_len"])[None, :, None, None]
    dead = (pos >= np.array(c["lengths"])[:, None, None, None]) | (
        pos < np.array(starts)[:, None, None, None]
    )
    poisoned_k, poisoned_v = (jnp.asarray(np.where(dead, np.nan, x), c["dtype"]) for x in (k, v))
    out = _decode(
        jnp.asarray(q, c["dtype"]),
        poisoned_k,
        poisoned_v,
        jnp.asarray(c["lengths"], jnp.int32),
        kv_start=None if c["kv_start"] is None else jnp.asarray(c["kv_start"], jnp.int32),
        window=c["window"],
        softcap=c["softcap"],
        block_k=c["block_k"],
    )
    clean_k, clean_v = (np.where(dead, 0.0, x) for x in (k, v))
    expected = _numpy_decode(
        q,
        clean_k,
        clean_v,
        c["lengths"],
        starts,
        c["window"],
        c["softcap"],
        c["head_dim"] ** -0.5,
    )
    _assert_matches(out, expected, c["dtype"])


@settings(max_examples=4)  # every example compiles a kernel for new shapes; broadly: slow
@given(decode_cases())
def test_decode_attention_matches_float64(c):
    _check_decode(c)


@pytest.mark.slow
@settings(max_examples=60)
@given(decode_cases())
def test_decode_attention_matches_float64_broadly(c):
    _check_decode(c)


def test_decode_attention_over_several_blocks():
    """A fixed case with every feature: 5 blocks of 8 keys, rows of length 0, shorter than
    the new tokens, mid-block and full, left padding, a window, a soft-cap, GQA."""
    _check_decode(
        {
            "batch": 4,
            "new": 3,
            "heads": 6,
            "kv_heads": 2,
            "head_dim": 16,
            "cache_len": 40,
            "lengths": [0, 2, 29, 40],
            "kv_start": [0, 1, 11, 3],
            "window": 10,
            "softcap": 4.0,
            "block_k": 8,
            "dtype": jnp.float32,
            "seed": 7,
        }
    )


def test_cache_block_divides_the_cache_in_whole_sublane_tiles():
    assert _cache_block(4096, 8, 256, jnp.bfloat16) == 256
    assert _cache_block(40, 2, 8, jnp.float32) == 8
    assert _cache_block(24, 2, 16, jnp.bfloat16) == 8  # 12 tokens would be 24 rows
    assert _cache_block(40, 1, 4, jnp.float32) == 40  # no divisor fills a tile: whole cache


@st.composite
def paged_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([8, 16]))
    pages_per_seq = draw(st.integers(1, 4))
    capacity = page_size * pages_per_seq
    length = st.sampled_from([0, capacity]) | st.integers(0, capacity)
    return {
        "shape": {
            "batch": batch,
            "new": draw(st.integers(1, 4)),
            "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
            "kv_heads": kv_heads,
            "head_dim": draw(st.sampled_from([16, 64])),
            "page_size": page_size,
            "pages_per_seq": pages_per_seq,
            "spare": draw(st.integers(0, 3)),
        },
        "lengths": [draw(length) for _ in range(batch)],
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "pages_per_block": draw(st.sampled_from([None, 1, 2, 3])),
        "layers": draw(st.sampled_from([None, 2, 3])),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _poison(k, v, table, lengths):
    """NaN in every pool slot no row uses (unused pages, each row's last page's tail) and
    garbage (-1 / past the pool, alternating) in every unused table entry."""
    page_size, pages_per_seq = k.shape[1], table.shape[1]
    live = np.zeros(k.shape[:2], bool)
    for b, n in enumerate(lengths):
        for pos in range(n):
            live[table[b, pos // page_size], pos % page_size] = True
    bad_k, bad_v = (np.where(live[:, :, None, None], x, np.float32(np.nan)) for x in (k, v))
    used = -(-np.asarray(lengths) // page_size)
    unused = np.arange(pages_per_seq)[None, :] >= used[:, None]
    garbage = np.where(np.arange(pages_per_seq) % 2, -1, k.shape[0] + 2**20)[None, :]
    return bad_k, bad_v, np.where(unused, garbage, table).astype(np.int32)


def _stack(x, layers, layer):
    """``layers`` pools, ``x`` at ``layer`` and NaN elsewhere."""
    stacked = np.full((layers, *x.shape), np.nan, np.float32)
    stacked[layer] = x
    return stacked


def _check_paged(c):
    q, k, v, table = _pool(c["seed"], **c["shape"])
    dtype = c["dtype"]
    q, k, v = (np.asarray(jnp.asarray(x).astype(dtype), np.float32) for x in (q, k, v))
    bad_k, bad_v, bad_table = _poison(k, v, table, c["lengths"])
    layer = None
    if c["layers"] is not None:
        layer = c["seed"] % c["layers"]
        bad_k, bad_v = (_stack(x, c["layers"], layer) for x in (bad_k, bad_v))
        layer = jnp.int32(layer)  # traced: one program serves every layer
    out = _paged(
        jnp.asarray(q, dtype),
        jnp.asarray(bad_k, dtype),
        jnp.asarray(bad_v, dtype),
        bad_table,
        jnp.asarray(c["lengths"], jnp.int32),
        layer=layer,
        window=c["window"],
        softcap=c["softcap"],
        pages_per_block=c["pages_per_block"],
    )
    expected = _numpy_paged(
        q, k, v, table, c["lengths"], c["window"], c["softcap"], c["shape"]["head_dim"] ** -0.5
    )
    _assert_matches(out, expected, dtype)


@settings(max_examples=3)  # every example compiles a kernel for new shapes; broadly: slow
@given(paged_cases())
def test_paged_decode_attention_matches_float64(c):
    _check_paged(c)


@pytest.mark.slow
@settings(max_examples=60)
@given(paged_cases())
def test_paged_decode_attention_matches_float64_broadly(c):
    _check_paged(c)


def test_garbage_entries_and_stale_pages_change_nothing():
    """Bit for bit: poisoned pools and tables (``_poison``) give the clean output, and a row
    of length 0 gives zeros."""
    q, k, v, table = _pool(2, 3, 2, 4, 2, 64, 8, 5, 4)
    lengths = np.array([0, 13, 40], np.int32)
    clean = _paged(q, k, v, table, lengths, window=9, pages_per_block=2)
    bad_k, bad_v, bad_table = _poison(k, v, table, lengths)
    assert np.isnan(bad_k[table[1, 1], 5:]).all()  # the tail of row 1's last page
    out = _paged(q, bad_k, bad_v, bad_table, lengths, window=9, pages_per_block=2)
    np.testing.assert_array_equal(out, clean)
    assert not np.asarray(out[0]).any()


def test_stacked_pools_are_read_at_a_traced_layer():
    q, k, v, table = _pool(3, 2, 1, 4, 2, 16, 16, 3, 2)
    lengths = np.array([20, 48], np.int32)
    k_stack, v_stack = np.stack([k, 2 * k, -k]), np.stack([v, v + 1, 3 * v])
    for layer in (0, 2):  # one program for both: the layer is a traced scalar
        out = _paged(q, k_stack, v_stack, table, lengths, layer=jnp.int32(layer))
        at_layer = _paged(q, k_stack[layer], v_stack[layer], table, lengths)
        np.testing.assert_array_equal(out, at_layer)


def test_plain_interpret_mode_agrees():
    """``interpret=True`` (Pallas' generic interpreter) computes the same thing."""
    q, k, v, table = _pool(4, 2, 3, 4, 2, 16, 8, 3, 1)
    lengths = np.array([7, 24], np.int32)
    expected = _numpy_paged(q, k, v, table, lengths, 5, None, 0.25)
    out = jax.jit(functools.partial(paged_decode_attention, window=5, scale=0.25, interpret=True))(
        q, k, v, table, lengths
    )
    assert _rel_err(out, expected) < 1e-5


@pytest.mark.parametrize(("window", "per_step"), [(None, 1), (None, 3), (6, 1), (6, 2)])
def test_index_maps_fetch_only_needed_pages(window, per_step):
    """Evaluated over the grid, the index maps touch only used table entries (and, with a
    window, only pages some query may see), never the garbage past them. With one page per
    step each needed page is fetched exactly once per row, in order: steps with nothing to
    see repeat the previous index, so Pallas issues no DMA for them."""
    page_size, pages_per_seq, num_pages, new_tokens = 4, 6, 30, 2
    lengths = np.array([0, 1, 9, 24], np.int32)
    table = np.random.default_rng(5).permutation(num_pages)[:24].reshape(4, pages_per_seq)
    used = -(-lengths // page_size)
    table = np.where(np.arange(pages_per_seq) >= used[:, None], -7, table).astype(np.int32)
    steps = -(-pages_per_seq // per_step)
    plan = Plan(
        new_tokens=new_tokens,
        heads=2,
        kv_heads=1,
        window=window,
        softcap=None,
        scale=1.0,
        block_tokens=page_size,
        blocks_per_step=per_step,
        steps=steps,
        capacity=pages_per_seq * page_size,
    )
    maps = [
        _page_spec(i, num_pages, 1, pages_per_seq, 4, 16, plan).index_map for i in range(per_step)
    ]
    args = (jnp.asarray(lengths), jnp.asarray(table.reshape(-1)), jnp.zeros((1,), jnp.int32))
    for b, length in enumerate(lengths):
        first = 0 if window is None else max(0, length - new_tokens - window + 1)
        needed = [int(p) for p in table[b, first // page_size : used[b]]] or [0]  # 0: clamped
        for m in maps:
            fetched = [int(m(b, step, *args)[1]) for step in range(steps)]
            assert set(fetched) <= set(needed), (b, fetched)
            if per_step == 1:
                distinct = [p for i, p in enumerate(fetched) if i == 0 or p != fetched[i - 1]]
                assert distinct == needed, (b, fetched)


def test_errors_name_the_problem():
    q = jnp.zeros((2, 1, 4, 16))
    cache = jnp.zeros((2, 32, 2, 16))
    lengths = jnp.array([1, 2], jnp.int32)
    with pytest.raises(TypeError, match="float32/bfloat16, got float16/float16/float16"):
        decode_attention(q.astype(jnp.float16), *(cache.astype(jnp.float16),) * 2, lengths)
    with pytest.raises(TypeError, match="got float32/bfloat16/float32"):
        decode_attention(q, cache.astype(jnp.bfloat16), cache, lengths)
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \(2,\)"):
        decode_attention(q, cache, cache, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="4 heads not a multiple of 3 kv heads"):
        decode_attention(q, jnp.zeros((2, 32, 3, 16)), jnp.zeros((2, 32, 3, 16)), lengths)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        decode_attention(q, cache, cache, lengths, window=0)

    pool, table = jnp.zeros((10, 8, 2, 16)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"page_table must be of shape \(2, pages_per_seq\)"):
        paged_decode_attention(q, pool, pool, jnp.zeros((3, 3), jnp.int32), lengths)
    with pytest.raises(ValueError, match=r"k_pages must be 5-d .* with layer="):
        paged_decode_attention(q, pool, pool, table, lengths, layer=0)
    with pytest.raises(ValueError, match="k_pages must be 4-d"):
        paged_decode_attention(q, pool[None], pool[None], table, lengths)
    with pytest.raises(ValueError, match="heads must be a multiple of the 3 kv heads"):
        paged_decode_attention(q, *(jnp.zeros((10, 8, 3, 16)),) * 2, table, lengths)
    with pytest.raises(TypeError, match="float32/bfloat16, got float32/bfloat16/bfloat16"):
        paged_decode_attention(q, *(pool.astype(jnp.bfloat16),) * 2, table, lengths)
    # Under the test suite's jaxtyping hook the annotation may name the argument first.
    with pytest.raises(TypeError, match="page_table"):
        paged_decode_attention(q, pool, pool, table.astype(jnp.float32), lengths)
    with pytest.raises((ValueError, TypeError), match="v_pages"):
        paged_decode_attention(q, pool, jnp.zeros((11, 8, 2, 16)), table, lengths)


def _lower_for_tpu(fn, *shapes) -> str:
    """Lower ``fn`` for TPU from this CPU-only host: Pallas emits the Mosaic kernel here
    (block shapes and every in-kernel op checked by its TPU lowering rules)."""
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()


def test_decode_attention_lowers_to_one_mosaic_kernel():
    def run(q, k, v, lengths, start):
        return decode_attention(q, k, v, lengths, kv_start=start, window=128, softcap=30.0)

    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    text = _lower_for_tpu(run, q, cache, cache, lengths, lengths)
    assert text.count("tpu_custom_call") == 1
    assert "dynamic_slice" not in text and "gather" not in text and "pad" not in text


@pytest.mark.parametrize(("page_size", "new_tokens"), [(16, 1), (64, 3)])
def test_paged_decode_attention_lowers_without_copying_a_layer(page_size, new_tokens):
    """One Mosaic kernel reading the stacked pools in place: no op slices or gathers a
    layer's pool (or produces a tensor of its shape) before the kernel."""

    def run(q, k, v, table, lengths, layer):
        return paged_decode_attention(q, k, v, table, lengths, layer=layer, window=256)

    layers, num_pages = 6, 300
    q = jax.ShapeDtypeStruct((4, new_tokens, 32, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((layers, num_pages, page_size, 8, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((4, 40), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    text = _lower_for_tpu(run, q, pool, pool, table, lengths, layer)
    assert text.count("tpu_custom_call") == 1
    assert "dynamic_slice" not in text and "gather" not in text
    for shape in ((num_pages, page_size, 8, 128), (num_pages, page_size * 8, 128)):
        assert f"tensor<{'x'.join(map(str, shape))}xbf16>" not in text  # one layer's pool
    # The kernel's K and V operands are the whole stacks, viewed as rows by free reshapes.
    assert f"tensor<{layers}x{num_pages}x{page_size * 8}x128xbf16>" in text


def _numpy_decode_with_sinks(q, k, v, lengths, window, sinks):
    """float64: each query's softmax over its visible keys plus its head's sink logit (which
    attends to nothing); a row with no visible key gives zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, new, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    keys = np.arange(k.shape[1])
    for b, t, h in np.ndindex(batch, new, heads):
        pos = lengths[b] - new + t
        seen = (keys <= pos) & (keys < lengths[b])
        if window is not None:
            seen &= pos - keys < window
        s = k[b, seen, h // group] @ q[b, t, h] * dim**-0.5
        top = max(s.max(initial=-np.inf), sinks[h])
        p = np.exp(s - top)
        out[b, t, h] = p @ v[b, seen, h // group] / (p.sum() + np.exp(sinks[h] - top))
    return out


@pytest.mark.parametrize("new_tokens", [1, pytest.param(3, marks=pytest.mark.slow)])  # ~3 s each
def test_decode_kernels_with_sinks_match_float64(new_tokens):
    """Attention sinks (GPT-OSS) in both TPU kernels, interpreted: GQA of 3 query heads per
    kv head, a row of length 0 (zeros), rows of other lengths, a window; the paged kernel
    over the same cache as pages. Sinks of +-4 move the output (checked)."""
    rng = np.random.default_rng(21)
    batch, cache_len, kv_heads, heads, dim, page = 3, 32, 2, 6, 16, 16
    q = rng.standard_normal((batch, new_tokens, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, cache_len, kv_heads, dim)).astype(np.float32) for _ in "kv")
    sinks = (4.0 * rng.uniform(-1, 1, heads)).astype(np.float32)
    lengths = np.array([0, 32, 17], np.int32)
    expected = _numpy_decode_with_sinks(q, k, v, lengths, 9, sinks)
    assert (
        np.abs(expected - _numpy_decode(q, k, v, lengths, [0] * batch, 9, None, dim**-0.5)).max()
        > 1e-2
    )
    out = _decode(q, k, v, lengths, window=9, sinks=jnp.asarray(sinks))
    _assert_matches(out, expected, jnp.float32)
    pages = [x.reshape(batch * cache_len // page, page, kv_heads, dim) for x in (k, v)]
    table = np.arange(batch * 2, dtype=np.int32).reshape(batch, 2)
    paged = _paged(q, *pages, table, lengths, window=9, sinks=jnp.asarray(sinks))
    _assert_matches(paged, expected, jnp.float32)
    # (Under the tests' beartype the annotations refuse a wrong shape first.)
    for bad in (jnp.zeros((2,), jnp.float32), jnp.zeros((6,), jnp.int32)):
        with pytest.raises(ValueError, match=r"sinks must be a float \(6,\) vector"):
            check_sinks("decode", bad, heads)


def test_decode_kernels_with_sinks_lower_to_one_mosaic_kernel():
    def run(q, k, v, lengths, sinks):
        return decode_attention(q, k, v, lengths, window=128, sinks=sinks)

    def run_paged(q, k, v, table, lengths, sinks):
        return paged_decode_attention(q, k, v, table, lengths, sinks=sinks)

    q = jax.ShapeDtypeStruct((2, 1, 32, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    sinks = jax.ShapeDtypeStruct((32,), jnp.float32)
    assert _lower_for_tpu(run, q, cache, cache, lengths, sinks).count("tpu_custom_call") == 1
    pool = jax.ShapeDtypeStruct((64, 16, 8, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    text = _lower_for_tpu(run_paged, q, pool, pool, table, lengths, sinks)
    assert text.count("tpu_custom_call") == 1
