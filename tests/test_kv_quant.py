"""Quantized KV caches (``edl.ops.kv_quant``): the formats' round trips against a float64
numpy reference, paged attention over quantized pages against attention over the
dequantized float64 cache (the kernels themselves: test_kernels_quantized_pages.py), and
``generate`` / the serving engine on an int8 cache (prefix sharing included)."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.generate import generate
from edl.generate.paged import _page_bytes, check_quantizable, init_paged_cache
from edl.models import DeepseekV3Config, LlamaConfig, LlamaForCausalLM, Qwen3NextConfig
from edl.ops.cached_attention import paged_attention
from edl.ops.kv_quant import KV_CACHE_DTYPES, QuantizedPages, dequantize_kv, quantize_kv
from edl.serve import Engine, SamplingParams

FP8_MANTISSA_BITS = 3  # float8_e4m3fn: relative spacing 2**-3, rounding error half that
FP8_SUBNORMAL_STEP = 2.0**-9  # its smallest subnormal


def _vectors(seed: int) -> np.ndarray:
    """Key-like vectors over many magnitudes, one all-zero, one with a lone outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 3, 16)) * 10.0 ** rng.uniform(-3, 3, (6, 3, 1))
    x[0, 0] = 0.0
    x[1, 2, 5] = 1e4
    return x.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_round_trip_within_half_a_scale(seed):
    x = _vectors(seed)
    codes, scales = quantize_kv(jnp.asarray(x), "int8")
    assert codes.dtype == jnp.int8 and scales.dtype == jnp.float32 and scales.shape == (6, 3, 1)
    x64 = x.astype(np.float64)
    want_scale = np.abs(x64).max(-1, keepdims=True) / 127
    np.testing.assert_allclose(np.asarray(scales, np.float64), want_scale, rtol=1e-6)
    assert np.abs(np.asarray(codes)).max() <= 127
    back = np.asarray(dequantize_kv(codes, scales, jnp.float32), np.float64)
    # Half a step of rounding, plus float32's own rounding of x / s and of q * s.
    bound = want_scale / 2 * (1 + 1e-5) + np.abs(x64) * 2e-7
    assert np.all(np.abs(back - x64) <= bound)
    assert np.all(back[0, 0] == 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_round_trip_within_its_rounding(seed):
    x = _vectors(seed)
    codes, scales = quantize_kv(jnp.asarray(x), "fp8_e4m3")
    assert codes.dtype == jnp.float8_e4m3fn
    x64 = x.astype(np.float64)
    scale = np.abs(x64).max(-1, keepdims=True) / 448
    back = np.asarray(dequantize_kv(codes, scales, jnp.float32), np.float64)
    # Round to nearest: half the spacing 2**(e - 3) of |x / s|'s binade, or of the
    # subnormals below 2**-6.
    rel = np.abs(x64) / np.where(scale > 0, scale, 1)
    spacing = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(rel, 2.0**-6))) - 3), 2.0**-9)
    bound = scale * spacing / 2 * (1 + 1e-5) + np.abs(x64) * 2e-7
    assert np.all(np.abs(back - x64) <= bound)
    assert np.abs(back - x64).max() > 0  # it did round


def test_registry_names_and_bytes():
    assert list(KV_CACHE_DTYPES) == ["auto", "int8", "fp8_e4m3"]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
        quantize_kv(jnp.ones((2, 4)), "int4")
    with pytest.raises(ValueError, match="nothing to quantize"):
        quantize_kv(jnp.ones((2, 4)), "auto")

    config = _config(kv_heads=4, head_dim=128)
    f32 = _page_bytes(config, 16, jnp.float32)
    bf16 = _page_bytes(config, 16, jnp.bfloat16)
    int8 = _page_bytes(config, 16, jnp.bfloat16, "int8")
    assert f32 == 2 * bf16 and int8 == _page_bytes(config, 16, jnp.float32, "fp8_e4m3")
    assert int8 == 2 * 16 * 2 * 4 * (128 + 4)  # codes plus one float32 scale per head


def _config(kv_heads: int, head_dim: int) -> LlamaConfig:
    """A 2-layer config of this cache geometry (only the cache reads it)."""
    return LlamaConfig(
        vocab_size=8,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )


def _masked_reference(q, k, v, lengths):
    """float64 attention of each row's newest queries over its first ``lengths`` keys."""
    _, new, heads, dim = q.shape
    group = heads // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
    q_pos = lengths[:, None] - new + np.arange(new)[None]
    k_pos = np.arange(k.shape[1])
    mask = (k_pos[None, None] <= q_pos[:, :, None]) & (k_pos[None, None] < lengths[:, None, None])
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.gpu  # XLA's dequantizing read and "auto"'s kernel on the device too
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_paged_read_is_attention_over_the_dequantized_cache(fmt):
    keys = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(key, (2, 10, 2, 8)) for key in keys[:2])

    @jax.jit  # one program: op by op, building the cache compiles for seconds
    def filled(k, v):
        cache = init_paged_cache(_config(2, 8), 9, 4, batch=2, cache_len=12, kv_cache_dtype=fmt)
        num_new = jnp.array([10, 6], jnp.int32)
        return cache.reserve(num_new).update(1, k, v).advance(num_new)

    cache = filled(k, v)
    assert isinstance(cache.k_pages, QuantizedPages)
    assert cache.k_pages.dtype == jnp.dtype(KV_CACHE_DTYPES[fmt].storage)
    q = jax.random.normal(keys[2], (2, 2, 4, 8))
    lengths = np.asarray(cache.lengths)
    table = np.asarray(cache.page_table)

    def logical(pages: QuantizedPages) -> np.ndarray:  # dequantized in float64, row by row
        values = np.asarray(pages.values[1], np.float64) * np.asarray(pages.scales[1])
        return values[table].reshape(2, -1, 2, 8)

    want = _masked_reference(
        np.asarray(q, np.float64), *map(logical, (cache.k_pages, cache.v_pages)), lengths
    )
    for impl in ("reference", "xla") if fmt == "int8" else ("xla",):  # compiles cost seconds
        read = jax.jit(lambda *a, impl=impl: paged_attention(*a, layer=1, impl=impl))
        got = read(q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, err_msg=impl)
    # The stored values are the inputs rounded, not the inputs.
    assert not np.allclose(logical(cache.k_pages)[0, :10], np.asarray(k[0], np.float64), atol=1e-7)

    if fmt != "int8":
        return
    # "auto" reads quantized pages with the platform's kernel (native on CPU), quietly.
    args = (q, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = jax.jit(lambda *a: paged_attention(*a, layer=1))(*args)
    np.testing.assert_allclose(np.asarray(auto, np.float64), want, atol=2e-6)


def test_quantized_caches_are_refused_where_not_done(tiny_llama):
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="needs the paged cache"):
        generate(tiny_llama, ids, max_new_tokens=2, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        generate(tiny_llama, ids, max_new_tokens=2, page_size=4, kv_cache_dtype="int4")
    for config, why in ((DeepseekV3Config(), "latent"), (Qwen3NextConfig(), "recurrent")):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='int8'.*{why}"):
            check_quantizable(config, "int8")
        with pytest.raises(ValueError, match=why):
            init_paged_cache(config, 4, 4, batch=1, cache_len=8, kv_cache_dtype="fp8_e4m3")


def test_engine_pools_are_quantized_pages(tiny_llama):
    engine = Engine(tiny_llama, max_batch=2, max_model_len=16, page_size=8, kv_cache_dtype="int8")
    for pool in (engine._k_pages, engine._v_pages):
        assert isinstance(pool, QuantizedPages) and pool.dtype == jnp.int8
        assert pool.shape == (2, engine.num_total_pages, 8, 2, 8)
        assert pool.scales.shape == (2, engine.num_total_pages, 8, 2, 1)
    assert engine._k_pages.values is not engine._v_pages.values  # each step donates both
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(tiny_llama, max_batch=2, max_model_len=16, kv_cache_dtype="int4")


@pytest.mark.gpu
@pytest.mark.slow  # about 20 s: generate twice and the engine's four step shapes compile
def test_engine_on_an_int8_cache_matches_generate_with_shared_prefixes(tiny_llama):
    """Several requests, one sharing another's whole prompt pages, on int8 pages: the
    engine's greedy tokens are ``generate``'s on the same int8 cache, every page comes
    back, and the quantized logits differ from the float cache's (it did quantize)."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 19).tolist(), rng.integers(0, 64, 5).tolist()
    c = [*a[:16], 7, 7, 3]
    prompts, max_new = [a, b, c], 6
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = dict(attention_mask=mask, max_new_tokens=max_new, page_size=8, logprobs=0)
    quantized = generate(tiny_llama, ids, kv_cache_dtype="int8", **options)
    plain = generate(tiny_llama, ids, **options)
    drift = np.abs(np.asarray(quantized.logprobs) - np.asarray(plain.logprobs))
    assert 0 < drift.max() < 0.05
    want = np.asarray(quantized.sequences[:, width:]).tolist()

    engine = Engine(
        tiny_llama,
        max_batch=4,
        max_model_len=32,
        page_size=8,
        prefill_chunk=8,
        kv_cache_dtype="int8",
    )
    assert isinstance(engine._k_pages, QuantizedPages)
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0)
    rids = [engine.add_request(p, greedy) for p in prompts[:2]]
    got, step, shared = {}, 0, None
    while engine.has_unfinished() or step < 4:
        if step == 3:  # C joins while A decodes: A's two whole prompt pages are shared
            rids.append(engine.add_request(c, greedy))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step == 3:
            pages = {r.id: r.pages for r in engine._running}
            shared = pages[rids[2]][:2] == pages[rids[0]][:2]
        step += 1
        assert step < 100
    assert shared and [got[r] for r in rids] == want
    assert engine.num_free_pages == engine.num_total_pages


def test_kv_cache_dtype_flags(tmp_path, capsys):
    from edl.cli import _check_serve, _parser, main

    def served(*argv):
        args = _parser().parse_args(["serve", "--model", "m", *argv])
        _check_serve(args)
        return args.kv_cache.kv_cache_dtype

    assert served() == "auto" and served("--kv-cache-dtype", "fp8_e4m3") == "fp8_e4m3"
    for argv, message in (
        (["--kv-cache-dtype", "int4"], "got 'int4'"),
        (["--kv-cache-dtype", "int8", "--num-beams", "2"], "a quantized cache is paged"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", str(tmp_path), *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("edl generate: error: ") and message in err


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_quantized_engine_step_lowers_for_accelerators_with_their_kernels(platform):
    """The engine's decode step on int8 pools, lowered for a GPU / TPU from this machine:
    the paged Pallas kernels (``edl_paged_decode_attention``,
    ``edl_tpu_paged_decode_attention``) read the int8 codes, with no fallback warning."""
    from edl.serve.step import model_step

    config = _config(kv_heads=2, head_dim=64)
    model = eqx.filter_eval_shape(lambda: LlamaForCausalLM.init(config, key=jax.random.key(0)))
    model = jax.eval_shape(lambda m: m.unstacked(), model)
    pools = jax.eval_shape(lambda: QuantizedPages.zeros((2, 64, 16, 2, 64), "int8"))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    args = (model, pools, pools, ints(4, 8), ints(4), ints(4, 1), ints(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = model_step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "paged_decode_attention" in text and "i8" in text
    assert not any("quantized" in str(w.message) for w in caught)
