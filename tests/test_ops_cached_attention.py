"""edl.ops.cached_attention's XLA paths against float64 (tests/test_kernels_attention.py has
the reference and checks the Pallas kernel the same way).

Tolerances are relative to max(1, max |expected|): float32 accumulates over at most 64 keys
here (errors seen ~1e-7, bound 2e-5, as for the kernel); bfloat16 inputs are compared on the
same rounded inputs, and the probabilities are rounded to bfloat16 before ``P @ V``, so the
bound is a couple of units of bf16's 2^-8 resolution: 1e-2.
"""

import contextlib
import functools
import importlib
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_kernels_attention import _inputs, _numpy_decode, _rel_err

from edl.ops.cached_attention import cache_mask, cached_attention, paged_attention
from edl.ops.cpu import LIVE_BRANCHES, live_lengths, one_token_attention

_cached = jax.jit(cached_attention, static_argnames=("window", "softcap", "scale", "impl"))


# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu


@pytest.fixture
def on_cpu():
    """Run the test's programs on the CPU (the CPU's own decode forms, whatever the backend)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _runs_on(impl: str):
    """Where ``impl`` can run: "native" is edl's CPU kernel, so its programs go to the host's
    CPU whatever the default backend (on a GPU run it is still checked, there)."""
    if impl == "native":
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


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
@given(cases(), st.sampled_from(["xla", "auto", "native", "reference"]))
def test_cached_attention_matches_float64(c, impl):
    with _runs_on(impl):
        _check_cached_attention(c, impl)


def _check_cached_attention(c, impl):
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
    out = jax.jit(one_token_attention, static_argnames=("softcap", "scale"))(
        q, k, v, mask, softcap=3.0, scale=0.3
    )
    expected = _numpy_decode(q, k, v, lengths, [0] * 5, 20, 3.0, 0.3)
    assert out.dtype == dtype
    assert _rel_err(out, expected) < tol


@pytest.mark.usefixtures("on_cpu")
def test_decode_step_reads_the_cache_in_place_on_cpu():
    """On CPU "xla" with one new token takes the block-diagonal form (no (batch, kv_heads,
    len, dim) copy of the cache), several new tokens the grouped einsum; "auto" means "xla"
    there, and "native" by name reads the cache in place."""
    q, k, v, _ = _inputs(0, 2, 1, 32, 8, 4, 16)
    lengths = jnp.asarray([5, 32], jnp.int32)

    def hlo(q, impl):
        return _cached.lower(q, k, v, lengths, impl=impl).compile().as_text()

    one_token = hlo(q, "xla")
    assert "f32[2,32,8]" in one_token  # logits (batch, len, heads) from one dot per row
    assert "f32[2,4,32,16]" not in one_token  # the transposed cache of the grouped einsum
    assert "f32[2,4,32,16]" in hlo(q, "reference")

    def ops(impl):  # the compiled CPU program's instructions (opcode and shape), names aside
        return sorted(re.findall(r"= (\S+) ([\w-]+)\(", hlo(q, impl)))

    assert ops("auto") == ops("xla")  # lowered for CPU, "auto" keeps only the XLA branch
    assert "edl_decode_attention" not in hlo(q, "auto")
    assert "edl_paged_attention" in hlo(q, "native")  # by name: the cache read in place
    pallas = functools.partial(cached_attention, impl="pallas")
    assert "edl_decode_attention" in str(jax.make_jaxpr(pallas)(q, k, v, lengths))
    q3 = jnp.concatenate([q, q, q], axis=1)
    assert "f32[2,4,32,16]" in hlo(q3, "xla")


def test_paged_attention_xla_equals_contiguous():
    """The paged path's XLA impl gathers pages and shares the contiguous decode form."""
    q, k, v, _ = _inputs(3, 2, 1, 32, 4, 2, 8)
    pages = jnp.concatenate([k.reshape(8, 8, 2, 8), v.reshape(8, 8, 2, 8)])  # 16 pages
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    lengths = jnp.asarray([11, 30], jnp.int32)
    out = jax.jit(functools.partial(paged_attention, impl="xla"))(
        q, pages[:8], pages[8:], table, lengths
    )
    expected = _cached(q, k, v, lengths, impl="reference")
    np.testing.assert_allclose(out, expected, atol=2e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([1, 16]))
def test_live_lengths_cover_the_cache_in_equal_blocks(cache_len, multiple):
    sizes = live_lengths(cache_len, multiple)
    block = sizes[0]
    assert sizes[-1] == cache_len and len(sizes) <= LIVE_BRANCHES
    assert block % multiple == 0 or len(sizes) == 1
    assert list(sizes[:-1]) == list(range(block, cache_len, block))
    assert live_lengths(160) == tuple(range(16, 161, 16))
    assert live_lengths(4096) == tuple(range(256, 4097, 256))


def _poisoned_stack(seed, layers, batch, cache_len, kv_heads, d, live):
    """Stacked caches whose positions from ``live`` on are NaN (any read of them shows)."""
    k = jax.random.normal(jax.random.key(seed), (layers, batch, cache_len, kv_heads, d))
    v = jax.random.normal(jax.random.key(seed + 1), k.shape)
    past = (jnp.arange(cache_len) >= live)[None, None, :, None, None]
    return jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)


@pytest.mark.parametrize("impl", ["xla", "auto", "native", "reference", "pallas"])
@pytest.mark.parametrize("new", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~1 s each
def test_stacked_cache_at_a_layer_equals_that_layers_cache(impl, new):
    """``layer=`` (traced under jit, or a Python int) reads exactly that layer's cache."""
    with _runs_on(impl):
        _check_stacked_cache_at_a_layer(impl, new)


def _check_stacked_cache_at_a_layer(impl, new):
    q = jax.random.normal(jax.random.key(0), (3, new, 4, 8))
    k, v = _poisoned_stack(1, 3, 3, 64, 2, 8, live=64)
    lengths = jnp.asarray([5, 64, 40], jnp.int32)

    def at(layer):
        return cached_attention(q, k, v, lengths, layer=layer, window=24, impl=impl)

    for layer in (0, 2):
        expected = _numpy_decode(q, k[layer], v[layer], [5, 64, 40], [0] * 3, 24, None, 8**-0.5)
        assert _rel_err(jax.jit(at)(jnp.int32(layer)), expected) < 2e-5
        # A Python int, compiled whole (eagerly every op would compile on its own).
        direct = jax.jit(at, static_argnums=0)(layer)
        assert _rel_err(direct, expected) < 2e-5


@pytest.mark.parametrize("longest", [1, 16, 17, 40, 64])
@pytest.mark.usefixtures("on_cpu")
def test_cpu_decode_reads_only_the_live_prefix(longest):
    """On CPU the "xla" path reads no cache position at or past the end of the block holding
    the longest row (NaN there would show), and gives the float64 answer; "reference" reads
    the whole cache (the definition: NaN comes through)."""
    cache_len, block = 64, live_lengths(64)[0]
    live = min(-(-longest // block) * block, cache_len)
    k, v = _poisoned_stack(2, 2, 3, cache_len, 2, 8, live=live)
    q = jax.random.normal(jax.random.key(3), (3, 1, 4, 8))
    lengths = [1, longest, max(1, longest // 2)]
    run = functools.partial(cached_attention, q, k, v, jnp.asarray(lengths, jnp.int32), layer=1)
    out = jax.jit(functools.partial(run, impl="xla"))()
    clean = [np.nan_to_num(x[1]) for x in (k, v)]  # the NaN lie past every row's length
    expected = _numpy_decode(q, *clean, lengths, [0] * 3, None, None, 8**-0.5)
    assert _rel_err(out, expected) < 2e-5
    if live < cache_len:
        assert np.isnan(np.asarray(jax.jit(functools.partial(run, impl="reference"))())).any()


@pytest.mark.usefixtures("on_cpu")
def test_paged_pools_stacked_over_layers_read_only_the_live_pages():
    """``layer=`` on stacked page pools: one gather from the stack, only the table columns
    below the longest row (pages after them are NaN here), equal to the contiguous cache."""
    q, k, v, _ = _inputs(4, 2, 1, 32, 4, 2, 8)
    k_pages, v_pages = (x.reshape(8, 8, 2, 8) for x in (k, v))  # 8 pages of 8 per layer
    nan = jnp.full_like(k_pages, jnp.nan)
    k_stack, v_stack = jnp.stack([nan, k_pages]), jnp.stack([nan, v_pages])
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    lengths = jnp.asarray([3, 10], jnp.int32)  # two pages live: table columns 2-3 unread
    k_stack = k_stack.at[1, jnp.asarray([2, 3, 6, 7])].set(jnp.nan)
    v_stack = v_stack.at[1, jnp.asarray([2, 3, 6, 7])].set(jnp.nan)
    out = jax.jit(lambda layer: paged_attention(q, k_stack, v_stack, table, lengths, layer=layer))(
        jnp.int32(1)
    )
    expected = _numpy_decode(q, k, v, [3, 10], [0, 0], None, None, 8**-0.5)
    assert _rel_err(out, expected) < 2e-5
    pallas = jax.jit(functools.partial(paged_attention, layer=1, impl="pallas"))(
        q, k_stack, v_stack, table, lengths
    )
    assert _rel_err(pallas, expected) < 2e-5
    # A table trimmed to the live pages, read whole (the serving engine's form): the same.
    whole = jax.jit(functools.partial(paged_attention, layer=1, live_prefix=False))(
        q, k_stack, v_stack, table[:, :2], lengths
    )
    assert _rel_err(whole, expected) < 2e-5


def test_cache_rank_must_match_layer():
    q, k, v, _ = _inputs(5, 2, 1, 16, 4, 2, 8)
    lengths = jnp.asarray([3, 16], jnp.int32)
    with pytest.raises(ValueError, match=r"pass layer= .*\(3, 2, 16, 2, 8\)|\(3, 2, 16, 2, 8\)"):
        cached_attention(q, jnp.stack([k] * 3), jnp.stack([v] * 3), lengths)
    with pytest.raises(ValueError, match=r"stacked over layers, 5-d, got shape \(2, 16, 2, 8\)"):
        cached_attention(q, k, v, lengths, layer=0)


def test_the_gpu_kernels_decline_heads_wider_than_shared_memory_holds():
    """A 576-wide head (DeepSeek-V3's MLA latent) asked an H200 for 594 KB of shared memory
    (232 KB there): "auto" must pick XLA for it, naming why, on GPUs too."""
    full = importlib.import_module("edl.ops.attention")  # edl.ops.attention: the function
    cached = importlib.import_module("edl.ops.cached_attention")

    q = jnp.zeros((1, 1, 2, 576), jnp.bfloat16)
    cache = jnp.zeros((1, 64, 1, 576), jnp.bfloat16)
    decode = cached._Options(window=None, softcap=None, scale=None)
    why = "head_dim 576 > 256 does not fit the GPU kernel's shared memory"
    assert cached._triton_decode_unsupported(decode, q, cache, cache) == why
    assert cached._triton_paged_unsupported(decode, q, cache, cache) == why
    prefill = full._Options(causal=True, window=None, softcap=None, scale=None)
    assert full._triton_unsupported(prefill, q, cache, cache, None, None, None) == why
    narrow = cache[..., :256]
    assert cached._triton_decode_unsupported(decode, q[..., :256], narrow, narrow) is None
