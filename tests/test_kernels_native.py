"""edl.kernels.native: the C++ paged attention for CPU against float64, and how
edl.ops.paged_attention picks it.

Tolerances as in test_ops_cached_attention.py: float32 sums over at most ~100 keys here
(errors seen ~1e-7, bound 2e-5); bfloat16 inputs are compared on the same rounded inputs with
the probabilities rounded to bfloat16 before ``P @ V``, a couple of units of 2^-8: 1e-2.
"""

import functools
import importlib
import os
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_kernels_attention import _numpy_decode, _rel_err

from edl.kernels import native
from edl.ops.cached_attention import NATIVE_MAX_NEW_TOKENS, paged_attention

# The module, not edl.ops' function of the same name.
platforms = importlib.import_module("edl.platforms")

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is CPU-only"),
    pytest.mark.skipif(
        native.unavailable() is not None, reason=f"native kernel: {native.unavailable()}"
    ),
]


def _paged_case(
    seed,
    *,
    batch,
    new,
    heads,
    kv_heads,
    d,
    page_size,
    pages_per_seq,
    layers,
    lengths,
    dtype=jnp.float32,
):
    """A contiguous cache per row and the same cache scattered over a shuffled pool stacked
    over layers; every pool slot no row owns at or below its length is NaN (a read of one
    shows), and table columns past a row's pages hold -1 or out-of-range ids."""
    rng = np.random.default_rng(seed)
    cache_len = pages_per_seq * page_size
    q = rng.standard_normal((batch, new, heads, d), np.float32)
    k = rng.standard_normal((batch, cache_len, kv_heads, d), np.float32)
    v = rng.standard_normal((batch, cache_len, kv_heads, d), np.float32)
    num_pages = batch * pages_per_seq + 3
    order = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    k_pool = np.full((layers, num_pages, page_size, kv_heads, d), np.nan, np.float32)
    v_pool = k_pool.copy()
    layer = layers - 1
    for b in range(batch):
        for p in range(pages_per_seq):
            first = p * page_size
            live = max(0, min(page_size, lengths[b] - first))  # positions past the length: NaN
            k_pool[layer, order[b, p], :live] = k[b, first : first + live]
            v_pool[layer, order[b, p], :live] = v[b, first : first + live]
    table = order.astype(np.int32)
    for b in range(batch):
        used = -(-lengths[b] // page_size)
        table[b, used:] = rng.choice([-1, num_pages + 5, 0], size=pages_per_seq - used)
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return (
        cast(q),
        cast(k_pool),
        cast(v_pool),
        jnp.asarray(table),
        jnp.asarray(lengths, jnp.int32),
        layer,
        cast(k),
        cast(v),
    )


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    page_size = draw(st.sampled_from([1, 4, 16]))
    pages_per_seq = draw(st.integers(1, 6))
    new = draw(st.sampled_from([1, 1, 2, 4]))
    batch = draw(st.integers(1, 4))
    capacity = page_size * pages_per_seq
    return {
        "batch": batch,
        "new": new,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "kv_heads": kv_heads,
        "d": draw(st.sampled_from([8, 64])),
        "page_size": page_size,
        "pages_per_seq": pages_per_seq,
        "layers": draw(st.integers(1, 3)),
        "lengths": [draw(st.integers(0, capacity)) for _ in range(batch)],
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=25, deadline=None)
@given(cases())
def test_native_matches_float64(c):
    """Random GQA shapes, page sizes, windows, soft-caps and lengths from 0 (no key: zeros)
    to the table's capacity; NaN wherever no row's data lies."""
    shape = {
        key: c[key]
        for key in (
            "batch",
            "new",
            "heads",
            "kv_heads",
            "d",
            "page_size",
            "pages_per_seq",
            "layers",
            "lengths",
        )
    }
    q, k_pool, v_pool, table, lengths, layer, k, v = _paged_case(c["seed"], **shape)
    run = functools.partial(
        paged_attention, window=c["window"], softcap=c["softcap"], impl="native"
    )
    out = jax.jit(run)(q, k_pool, v_pool, table, lengths, layer=jnp.int32(layer))
    expected = _numpy_decode(
        q, k, v, c["lengths"], [0] * c["batch"], c["window"], c["softcap"], c["d"] ** -0.5
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_err(out, expected) < 2e-5


def test_bfloat16_and_one_layer_pools():
    """bfloat16 operands, and 4-d pools without ``layer=`` (a leading axis of one)."""
    q, k_pool, v_pool, table, lengths, _, k, v = _paged_case(
        1,
        batch=3,
        new=1,
        heads=8,
        kv_heads=2,
        d=64,
        page_size=16,
        pages_per_seq=4,
        layers=1,
        lengths=[5, 64, 33],
        dtype=jnp.bfloat16,
    )
    out = jax.jit(functools.partial(paged_attention, impl="native", scale=0.2, window=40))(
        q, k_pool[0], v_pool[0], table, lengths
    )
    expected = _numpy_decode(q, k, v, [5, 64, 33], [0] * 3, 40, None, 0.2)
    assert out.dtype == jnp.bfloat16
    assert _rel_err(out, expected) < 1e-2


def test_auto_picks_native_for_decode_steps_on_cpu():
    """On CPU, "auto" runs the native kernel for up to NATIVE_MAX_NEW_TOKENS new tokens and
    the gathered XLA form for longer chunks; both equal the definition."""
    q, k_pool, v_pool, table, lengths, layer, k, v = _paged_case(
        2,
        batch=2,
        new=NATIVE_MAX_NEW_TOKENS + 1,
        heads=4,
        kv_heads=2,
        d=8,
        page_size=4,
        pages_per_seq=4,
        layers=2,
        lengths=[9, 16],
    )
    # XLA's gathered form multiplies stale entries by zero probabilities: no NaN in its reads.
    k_pool, v_pool = jnp.nan_to_num(k_pool), jnp.nan_to_num(v_pool)

    def jaxpr(q):
        call = functools.partial(paged_attention, layer=layer, live_prefix=False)
        return str(jax.make_jaxpr(call)(q, k_pool, v_pool, table, lengths))

    few = q[:, -1:]
    assert "edl_paged_attention" in jaxpr(few)
    assert "edl_paged_attention" not in jaxpr(q)
    for queries in (few, q):
        out = jax.jit(functools.partial(paged_attention, layer=layer, live_prefix=False))(
            queries, k_pool, v_pool, table, lengths
        )
        expected = _numpy_decode(queries, k, v, [9, 16], [0, 0], None, None, 8**-0.5)
        assert _rel_err(out, expected) < 2e-5


def test_without_the_kernel_auto_falls_back_with_one_warning(monkeypatch):
    q, k_pool, v_pool, table, lengths, layer, k, v = _paged_case(
        3,
        batch=2,
        new=1,
        heads=4,
        kv_heads=2,
        d=8,
        page_size=4,
        pages_per_seq=2,
        layers=1,
        lengths=[3, 8],
    )
    k_pool, v_pool = jnp.nan_to_num(k_pool), jnp.nan_to_num(v_pool)  # XLA's form reads them
    monkeypatch.setattr(native, "unavailable", lambda: "no C++ compiler found (test)")
    monkeypatch.setattr(platforms, "_noticed", set())
    with pytest.warns(UserWarning, match=r"no C\+\+ compiler found \(test\); using impl='xla'"):
        out = paged_attention(q, k_pool, v_pool, table, lengths, layer=layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        paged_attention(q, k_pool, v_pool, table, lengths, layer=layer)
    assert _rel_err(out, _numpy_decode(q, k, v, [3, 8], [0, 0], None, None, 8**-0.5)) < 2e-5
    with pytest.raises(ValueError, match=r"impl='native' cannot run: no C\+\+ compiler"):
        paged_attention(q, k_pool, v_pool, table, lengths, layer=layer, impl="native")


def test_bad_inputs_name_the_problem():
    q, k_pool, v_pool, table, lengths, _, _, _ = _paged_case(
        4,
        batch=2,
        new=1,
        heads=4,
        kv_heads=2,
        d=8,
        page_size=4,
        pages_per_seq=2,
        layers=2,
        lengths=[3, 8],
    )
    with pytest.raises(ValueError, match="share float32 or bfloat16, got float32, bfloat16"):
        native.paged_attention_cpu(
            q, k_pool.astype(jnp.bfloat16), v_pool, table, lengths, 0, scale=1.0
        )
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(
            jax.jit(functools.partial(native.paged_attention_cpu, scale=1.0))(
                q, k_pool, v_pool, table, lengths, jnp.int32(2)
            )
        )
    with pytest.raises(ValueError, match="auto/pallas/native/xla/reference, got 'fast'"):
        paged_attention(q, k_pool, v_pool, table, lengths, layer=0, impl="fast")


def test_library_is_built_once_per_key_and_failures_name_the_command(tmp_path, monkeypatch):
    first = native.build_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build_library(tmp_path) == first and first.stat().st_mtime_ns == stamp
    # The library and its record, written atomically: no temporary left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{first.stem}.json", first.name]
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(RuntimeError, match=r"building edl.s native kernels failed \(false -O3"):
        native.build_library(tmp_path / "other")
    assert not any((tmp_path / "other").iterdir())
    monkeypatch.setenv("PATH", os.fspath(tmp_path))  # nothing to compile with
    monkeypatch.delenv("CXX")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        native.build_library(tmp_path / "third")
