"""The paged attention kernels on quantized pages (``edl.ops.kv_quant``, an int8 / fp8 KV
cache): the native CPU kernel, the Pallas kernel for GPU (interpreted on CPU, Triton on a
GPU) and the Mosaic TPU kernel (interpreted) against float64 attention over the dequantized
cache; ``"auto"`` picking them; quantized decode steps lowered for cuda / tpu holding them;
``generate`` with ``"auto"`` on an int8 cache equal to ``"xla"``.

Tolerances: the kernels dequantize ``codes * scale`` in float32 and round it to ``q``'s
dtype, as ``"xla"`` does, so float32 queries see the reference's keys and values up to
float32 rounding (errors seen ~2e-7, bound 2e-5); bfloat16 queries see them rounded to
bfloat16 and the probabilities rounded before ``P @ V``: 2e-2.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_kernels_paged import _numpy_paged, _rel_err

from edl.kernels import native, paged_decode_attention, tpu
from edl.ops.cached_attention import paged_attention
from edl.ops.kv_quant import QuantizedPages, quantize_kv

# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there): the
# Pallas kernel there is compiled through Triton.
ON_GPU = jax.default_backend() == "gpu"
NO_NATIVE = native.unavailable()


def _case(seed, *, fmt, batch, new, heads, kv_heads, d, page_size, pages_per_seq, lengths):
    """q, quantized K / V pools stacked over two layers (data at layer 1), a shuffled table
    and the pools dequantized in float64 at layer 1 (the reference's cache). Scales of slots
    past each row's length are NaN (a kernel that used one would show it) and table columns
    past a row's pages hold -1 or out-of-range ids."""
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_seq + 2
    shape = (2, num_pages, page_size, kv_heads, d)
    q = rng.standard_normal((batch, new, heads, d)).astype(np.float32)
    pools, logical = [], []
    order = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    for _ in range(2):
        x = rng.standard_normal(shape) * rng.uniform(0.1, 3.0, (*shape[:-1], 1))
        codes, scales = (np.array(a) for a in quantize_kv(jnp.asarray(x, jnp.float32), fmt))
        dequantized = codes[1].astype(np.float64) * scales[1]
        for b in range(batch):
            for p in range(pages_per_seq):
                stale = max(0, min(page_size, lengths[b] - p * page_size))
                scales[1, order[b, p], stale:] = np.nan
        pools.append(QuantizedPages(jnp.asarray(codes), jnp.asarray(scales), fmt))
        logical.append(dequantized)
    table = order.astype(np.int32)
    for b in range(batch):
        used = -(-lengths[b] // page_size)
        table[b, used:] = rng.choice([-1, num_pages + 5, 0], size=pages_per_seq - used)
    return q, *pools, table, np.asarray(lengths, np.int32), *logical


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(1, 2))
    page_size = draw(st.sampled_from([16] if ON_GPU else [4, 8, 16]))
    pages_per_seq = draw(st.integers(1, 3))
    capacity = page_size * pages_per_seq
    return {
        "fmt": draw(st.sampled_from(["int8", "fp8_e4m3"])),
        "batch": batch,
        "new": draw(st.integers(1, 2)),
        "heads": kv_heads * draw(st.sampled_from([1, 2])),
        "kv_heads": kv_heads,
        "d": draw(st.sampled_from([64, 128])),
        "page_size": page_size,
        "pages_per_seq": pages_per_seq,
        "lengths": [draw(st.integers(0, capacity)) for _ in range(batch)],
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _native(q, k, v, table, lengths, **kw):
    scales = {"k_scales": k.scales, "v_scales": v.scales}
    return native.paged_attention_cpu(q, k.values, v.values, table, lengths, 1, **kw, **scales)


def _pallas(q, k, v, table, lengths, **kw):  # Triton on a GPU, interpreted elsewhere
    scales = {"k_scales": k.scales, "v_scales": v.scales}
    return paged_decode_attention(q, k.values, v.values, table, lengths, layer=1, **kw, **scales)


def _tpu(q, k, v, table, lengths, **kw):
    scales = {"k_scales": k.scales, "v_scales": v.scales, "interpret": True}
    return tpu.paged_decode_attention(
        q, k.values, v.values, table, lengths, layer=1, **kw, **scales
    )


_CPU_ONLY = pytest.mark.skipif(
    ON_GPU or NO_NATIVE is not None, reason=f"the native kernel runs on CPU ({NO_NATIVE})"
)
KERNELS = {
    "native": pytest.param(_native, marks=_CPU_ONLY),
    "pallas": pytest.param(_pallas, marks=pytest.mark.gpu),
    "tpu": pytest.param(_tpu),
}


def _check(kernel, c):
    shape = {key: c[key] for key in ("batch", "new", "heads", "kv_heads", "d", "page_size")}
    q, k, v, table, lengths, k64, v64 = _case(
        c["seed"], fmt=c["fmt"], pages_per_seq=c["pages_per_seq"], lengths=c["lengths"], **shape
    )
    dtype = c["dtype"]
    q = jnp.asarray(q, dtype)
    scale = c["d"] ** -0.5
    run = jax.jit(functools.partial(kernel, window=c["window"], softcap=c["softcap"], scale=scale))
    out = run(q, k, v, jnp.asarray(table), jnp.asarray(lengths))
    if dtype == jnp.bfloat16:  # the kernels see bfloat16-rounded keys and values
        k64, v64 = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (k64, v64))
    want = _numpy_paged(q, k64, v64, table, lengths, c["window"], c["softcap"], scale)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, want) < (2e-5 if dtype == jnp.float32 else 2e-2)


@settings(max_examples=2, deadline=None)  # each example compiles: ~1 s
@given(c=cases())
@pytest.mark.parametrize("kernel", [KERNELS["native"]], ids=["native"])
def test_native_kernel_reads_quantized_pages_like_float64(kernel, c):
    _check(kernel, c)


# Interpreted Pallas kernels compile for ~3 s an example here: one each in the default suite
# (on a GPU the Triton kernel's), broadly in the slow set.
@settings(max_examples=1, deadline=None)
@given(c=cases())
@pytest.mark.parametrize("kernel", [KERNELS["pallas"], KERNELS["tpu"]], ids=["pallas", "tpu"])
def test_pallas_kernels_read_quantized_pages_like_float64(kernel, c):
    _check(kernel, c)


@pytest.mark.slow  # about 3 minutes: 25 compiles per kernel
@settings(max_examples=25, deadline=None)
@given(c=cases())
@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_kernels_read_quantized_pages_like_float64_broadly(kernel, c):
    _check(kernel, c)


def _small_case(fmt="int8"):
    """A small case with q, table and lengths as jax arrays (the references' float64 caches
    stay numpy)."""
    q, k, v, table, lengths, k64, v64 = _case(
        3,
        fmt=fmt,
        batch=2,
        new=1,
        heads=4,
        kv_heads=2,
        d=8,
        page_size=4,
        pages_per_seq=3,
        lengths=[9, 4],
    )
    return jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(lengths), k64, v64


@pytest.mark.skipif(NO_NATIVE is not None, reason=f"native kernel: {NO_NATIVE}")
def test_auto_reads_quantized_pages_with_the_native_kernel_on_cpu():
    """ "auto" on CPU runs the native kernel's quantized entry for decode steps, as for float
    pages; the result is attention over the dequantized cache."""
    q, k, v, table, lengths, k64, v64 = _small_case()
    read = functools.partial(paged_attention, layer=1)
    text = str(jax.make_jaxpr(read)(q, k, v, table, lengths))
    assert "edl_paged_attention_quantized" in text
    out = jax.jit(read)(q, k, v, table, lengths)
    want = _numpy_paged(q, k64, v64, np.asarray(table), np.asarray(lengths), None, None, 8**-0.5)
    assert _rel_err(out, want) < 2e-5


def test_kernels_name_bad_quantized_inputs():
    q, k, v, table, lengths, *_ = _small_case()
    wrong = jnp.zeros((*k.values.shape[:-1], 2), jnp.float32)
    calls = {
        "paged_decode_attention": functools.partial(paged_decode_attention, interpret=True),
        "tpu paged_decode_attention": functools.partial(tpu.paged_decode_attention, interpret=True),
    }
    for name, call in calls.items():
        args = (q, k.values, v.values, table, lengths)
        with pytest.raises(ValueError, match=f"{name}: .*k_scales must be float32"):
            call(*args, layer=1, k_scales=wrong, v_scales=v.scales)
        with pytest.raises(ValueError, match=f"{name}: .*k_scales.*v_scales"):
            call(*args, layer=1, k_scales=k.scales)
        floats = jnp.zeros(k.values.shape, jnp.float16)
        with pytest.raises(TypeError, match="int8 or float8_e4m3fn codes"):
            call(q, floats, floats, table, lengths, layer=1, k_scales=k.scales, v_scales=v.scales)
    if NO_NATIVE is None:
        with pytest.raises(ValueError, match="paged_attention_cpu: k_scales must have shape"):
            native.paged_attention_cpu(
                q, k.values, v.values, table, lengths, 1, scale=1.0, k_scales=wrong, v_scales=wrong
            )


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(
    ("platform", "marker"),
    [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "edl_tpu_paged_decode_attention")],
)
def test_quantized_paged_decode_lowers_to_the_pallas_kernel(platform, marker, fmt):
    """A bfloat16 decode step over quantized pools stacked over layers, lowered for a GPU /
    TPU from this host: one Pallas kernel reading the codes (no dequantized pool)."""
    pools = jax.eval_shape(lambda: QuantizedPages.zeros((2, 64, 16, 2, 128), fmt))
    q = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    read = jax.jit(lambda q, k, v, t, n: paged_attention(q, k, v, t, n, layer=1))
    text = (
        read.trace(q, pools, pools, ints(4, 8), ints(4))
        .lower(lowering_platforms=(platform,))
        .as_text()
    )
    assert text.count(marker) == 1
    code = "i8" if fmt == "int8" else "f8E4M3FN"
    assert f"2x64x16x2x128x{code}" in text
    assert "2x64x16x2x128xbf16" not in text  # the pool is never dequantized as a whole


def _llama(impl: str):
    """conftest's tiny Llama (same weights) with ``attention_impl=impl``."""
    from conftest import TINY_LLAMA

    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_LLAMA).replace(attention_impl=impl)
    return LlamaForCausalLM.init(config, key=jax.random.key(0))


@pytest.mark.slow  # about 25 s: two generate loops compile
@pytest.mark.skipif(NO_NATIVE is not None, reason=f"native kernel: {NO_NATIVE}")
def test_generate_on_an_int8_cache_with_auto_equals_xla(monkeypatch):
    """Greedy ``generate`` on an int8 paged cache: "auto" (decode steps through the native
    kernel's quantized entry, seen being traced) gives "xla"'s tokens and, within float32
    rounding, its log-probs."""
    from edl.generate import generate

    quantized_reads = []
    kernel = native.paged_attention_cpu

    def spy(*args, **kwargs):
        quantized_reads.append(kwargs.get("k_scales") is not None)
        return kernel(*args, **kwargs)

    ids = np.random.default_rng(0).integers(0, 64, (2, 7))
    options = dict(max_new_tokens=6, page_size=4, kv_cache_dtype="int8", logprobs=0)
    with monkeypatch.context() as patch:
        patch.setattr(native, "paged_attention_cpu", spy)
        auto = generate(_llama("auto"), ids, **options)
    assert any(quantized_reads)
    xla = generate(_llama("xla"), ids, **options)
    np.testing.assert_array_equal(np.asarray(auto.sequences), np.asarray(xla.sequences))
    np.testing.assert_allclose(np.asarray(auto.logprobs), np.asarray(xla.logprobs), atol=1e-5)


@pytest.mark.slow  # about 15 s: two engines' step shapes compile
@pytest.mark.skipif(NO_NATIVE is not None, reason=f"native kernel: {NO_NATIVE}")
def test_engine_on_an_int8_cache_with_auto_equals_xla():
    from edl.serve import Engine, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (9, 3, 14)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    outputs = []
    for impl in ("auto", "xla"):
        engine = Engine(
            _llama(impl), max_batch=4, max_model_len=32, page_size=8, kv_cache_dtype="int8"
        )
        rids = [engine.add_request(p, greedy) for p in prompts]
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append([got[r] for r in rids])
    assert outputs[0] == outputs[1] and all(len(o) == 5 for o in outputs[0])


@pytest.mark.skipif(NO_NATIVE is not None, reason=f"native kernel: {NO_NATIVE}")
@pytest.mark.parametrize("storage", [jnp.int8, jnp.float8_e4m3fn])
def test_native_kernel_decodes_every_code_exactly(storage):
    """Every int8 / fp8 e4m3fn code (fp8 subnormals included; NaN codes aside) as the value
    row of a row's one key, with scale 1: the output is the codes as float32, exactly (the
    C++ conversion, not XLA's, decodes them)."""
    bits = np.arange(256, dtype=np.uint8)
    # int8 -128 is never written (codes are clipped to +-127); fp8 S.1111.111 is NaN.
    skip = bits == 128 if storage == jnp.int8 else (bits & 0x7F) == 0x7F
    bits = bits[~skip]
    codes = jnp.asarray(bits.view(np.dtype(storage)))
    d = codes.shape[0]
    v = codes.reshape(1, 1, 1, 1, d)
    ones = jnp.ones((1, 1, 1, 1, 1), jnp.float32)
    q = jnp.zeros((1, 1, 1, d), jnp.float32)
    table, lengths = jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    out = native.paged_attention_cpu(
        q, jnp.zeros_like(v), v, table, lengths, 0, scale=1.0, k_scales=ones, v_scales=ones
    )
    np.testing.assert_array_equal(np.asarray(out).ravel(), np.asarray(codes, np.float32))
