"""Weight-only quantization: int8 / NF4 against an independent float64 numpy reference, the
formats' error bounds, QuantizedLinear, and quantized Llama models end to end (logits close
to float32, memory, checkpoints; generation is in test_lora)."""

from __future__ import annotations

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edl
from edl.io.checkpoint import load_state, save_state
from edl.models import LlamaForCausalLM
from edl.nn import Linear, QuantizedLinear, stack
from edl.ops.quant import NF4_CODE, dequantize_weight, quantize_weight, quantized_matmul
from edl.quantize import QuantConfig, is_quantized
from edl.quantize import dequantize as dequantize_model
from edl.quantize import quantize as quantize_model


def _nf4_reference_code() -> np.ndarray:
    """NF4 from its definition (QLoRA, appendix E; bitsandbytes ``create_normal_map``): the
    N(0, 1) quantiles at 8 points of ``linspace(offset, 1/2)`` (positive half) and 7 of
    ``linspace(offset, 1/2)`` mirrored (negative half), plus an exact zero, normalised to
    [-1, 1]; ``offset`` is the mean of ``1 - 1/(2*15)`` and ``1 - 1/(2*16)``."""
    offset = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    code = np.sort(np.array([*positive, 0.0, *negative]))
    return code / code.max()


REF_NF4 = _nf4_reference_code()
NF4_HALF_GAP = np.diff(REF_NF4).max() / 2  # the worst-case NF4 rounding, relative to absmax


def _reference(w: np.ndarray, fmt: str, block: int):
    """float64 block-wise absmax quantization, written from the formats' definitions.
    Returns (codes, dequantized, per-element scale, distance to a decision boundary)."""
    out, inp = w.shape[-2:]
    flat = w.reshape(*w.shape[:-2], out * inp).astype(np.float64)
    pad = -flat.shape[-1] % block
    blocks = np.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)])
    blocks = blocks.reshape(*blocks.shape[:-1], -1, block)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    if fmt == "int8":
        scale = absmax / 127
        normed = blocks / np.where(scale > 0, scale, 1)
        codes = np.clip(np.rint(normed), -127, 127)
        values, boundary = codes, np.abs(normed - np.floor(normed) - 0.5)
    else:
        scale = absmax
        normed = blocks / np.where(scale > 0, scale, 1)
        codes = np.abs(normed[..., None] - REF_NF4).argmin(-1)
        values = REF_NF4[codes]
        boundary = np.abs(normed[..., None] - (REF_NF4[1:] + REF_NF4[:-1]) / 2).min(-1)

    def crop(x):
        x = np.broadcast_to(x, blocks.shape).reshape(*blocks.shape[:-2], -1)
        return x[..., : out * inp].reshape(w.shape)

    return crop(codes), crop(values * scale), crop(scale), crop(boundary)


def _unpack_nf4(q: np.ndarray) -> np.ndarray:
    """bitsandbytes' packing: the first code of each pair in the high nibble."""
    q = np.asarray(q)
    return np.stack([q >> 4, q & 0xF], axis=-1).reshape(*q.shape[:-1], -1)


def test_nf4_code_book_is_the_normal_quantile_map():
    code = np.asarray(NF4_CODE)
    assert code.shape == (16,) and np.all(np.diff(code) > 0)
    assert code[0] == -1.0 and code[7] == 0.0 and code[-1] == 1.0
    np.testing.assert_allclose(code, REF_NF4, rtol=0, atol=2e-7)  # float32 storage


@settings(max_examples=12)  # each example compiles new shapes
@given(
    fmt=st.sampled_from(["int8", "nf4"]),
    lead=st.sampled_from([(), (3,)]),
    out=st.integers(1, 9),
    inp=st.integers(1, 40),
    block=st.sampled_from([2, 8, 64, "channel"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_matches_numpy_reference_within_format_bounds(fmt, lead, out, inp, block, seed):
    rng = np.random.default_rng(seed)
    # Rows of very different scales, heavy tails and an all-zero row.
    w = rng.standard_t(3, (*lead, out, inp)) * np.exp(rng.normal(0, 2, (*lead, out, 1)))
    w[..., 0, :] = 0.0
    w = w.astype(np.float32)
    size = inp if block == "channel" else block
    if fmt == "nf4" and size % 2:
        size += 1
    q, scales = quantize_weight(jnp.asarray(w), format=fmt, block_size=size)
    assert q.dtype == (jnp.int8 if fmt == "int8" else jnp.uint8)
    blocks = -(-out * inp // size)
    assert q.shape == (*lead, blocks, size if fmt == "int8" else size // 2)
    assert scales.shape == (*lead, blocks) and scales.dtype == jnp.float32
    back = np.asarray(dequantize_weight(q, scales, format=fmt, shape=(out, inp)), np.float64)

    codes, ref, scale, boundary = _reference(w, fmt, size)
    edl_codes = np.asarray(q, np.int64) if fmt == "int8" else _unpack_nf4(q)
    edl_codes = edl_codes.reshape(*lead, -1)[..., : out * inp].reshape(w.shape)
    # Away from decision boundaries (float32 vs float64 rounding) the codes are identical.
    clear = boundary > 1e-5
    np.testing.assert_array_equal(edl_codes[clear], codes[clear])
    np.testing.assert_allclose(back[clear], ref[clear], rtol=1e-6, atol=0)
    # The formats' bounds: half a code step (int8: scale/2; nf4: the widest NF4 gap / 2).
    bound = scale * (0.5 if fmt == "int8" else NF4_HALF_GAP) * (1 + 1e-5)
    assert np.all(np.abs(back - w) <= bound)
    assert np.all(back[..., 0, :] == 0.0)


def test_quantized_matmul_equals_the_dequantized_weight_in_float64():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 40)).astype(np.float32)
    x = rng.normal(size=(2, 5, 40)).astype(np.float32)
    for fmt in ("int8", "nf4"):
        q, s = quantize_weight(jnp.asarray(w), format=fmt, block_size=16)
        dense = np.asarray(dequantize_weight(q, s, format=fmt, shape=(24, 40)), np.float64)
        y = quantized_matmul(jnp.asarray(x), q, s, format=fmt, shape=(24, 40))
        np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ dense.T, atol=1e-4)
        half = quantized_matmul(jnp.asarray(x, jnp.bfloat16), q, s, format=fmt, shape=(24, 40))
        assert half.dtype == jnp.bfloat16


def test_quantized_linear_stacked_equals_per_layer_and_keeps_bias():
    keys = jax.random.split(jax.random.key(0), 3)
    layers = stack(lambda k: Linear.init(20, 12, use_bias=True, std=1.0, key=k), keys)
    layers = edl.tree.named_map(lambda p, x: x + 1.0 if p == "bias" else x, layers)
    ql = QuantizedLinear.from_linear(layers, format="nf4", block_size=16)
    assert ql.qweight.shape == (3, 15, 8) and ql.shape == (12, 20) and ql.block_size == 16
    for i in range(3):
        one = QuantizedLinear.from_linear(
            jax.tree.map(lambda a, i=i: a[i], layers), format="nf4", block_size=16
        )
        np.testing.assert_array_equal(np.asarray(ql.qweight[i]), np.asarray(one.qweight))
        x = jnp.ones((4, 20))
        np.testing.assert_allclose(
            np.asarray(one(x)), np.asarray(x @ one.weight.T + one.bias[None]), rtol=1e-5, atol=1e-5
        )
    dense = ql.dequantize()
    assert isinstance(dense, Linear) and dense.weight.shape == (3, 12, 20)
    np.testing.assert_array_equal(np.asarray(dense.bias), np.asarray(layers.bias))


# -- quantized models ------------------------------------------------------------------------


def _linear_bytes(tree, kind):
    return edl.nbytes(list(edl.tree.find(tree, lambda x: isinstance(x, kind)).values()))


@pytest.mark.parametrize(
    ("fmt", "max_rel"),
    # Relative RMS error of the logits of this random model (weights ~ N(0, 0.02)). The
    # weights' own relative RMS error is ~0.5% (int8 per channel: scale / sqrt(12), the
    # absmax of 32 normals being ~2.1 sigma) and ~9% (nf4 in 64-blocks); the logits measured
    # 0.36% and 5.3% (int8 and nf4 errors differ by ~15x, as the weights' do). Bounds: ~2.5x.
    [("int8", 0.01), ("nf4", 0.12)],
)
def test_quantized_llama_logits_stay_close_to_float32(tiny_llama, tiny_ids, fmt, max_rel):
    qmodel = quantize_model(tiny_llama, QuantConfig(fmt))
    assert is_quantized(qmodel) and not is_quantized(tiny_llama)
    ref = np.asarray(tiny_llama(tiny_ids).logits, np.float64)
    got = np.asarray(jax.jit(lambda m, i: m(i).logits)(qmodel, tiny_ids), np.float64)
    rel = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
    print(f"{fmt}: relative RMS logits error {rel:.4f}, max abs {np.abs(got - ref).max():.3g}")
    assert rel < max_rel
    # Not a no-op: the dequantized model gives the same logits as the quantized forward.
    dense = np.asarray(dequantize_model(qmodel)(tiny_ids).logits, np.float64)
    np.testing.assert_allclose(got, dense, rtol=0, atol=1e-5)
    assert np.abs(dense - ref).max() > 0


def test_quantized_bytes_are_a_quarter_and_an_eighth_plus_scales(tiny_llama):
    """fp32 weights: 4 bytes per element. int8 per channel: 1 byte + one float32 scale per
    output row, i.e. 1/4 + 1/in of fp32. nf4 in 64-blocks: half a byte + a float32 scale
    per 64 elements, i.e. (0.5 + 4/64) / 4 = 9/64 of fp32 (1/8 without the scales)."""
    dense = _linear_bytes(tiny_llama.model.layers, Linear)
    elements = dense // 4
    int8 = quantize_model(tiny_llama, QuantConfig("int8"))
    nf4 = quantize_model(tiny_llama, QuantConfig("nf4"))
    linears = edl.tree.find(tiny_llama.model.layers, lambda x: isinstance(x, Linear)).values()
    rows = sum(x.weight.shape[0] * x.weight.shape[1] for x in linears)  # (layers, out, in)
    assert _linear_bytes(int8, QuantizedLinear) == elements + 4 * rows
    assert _linear_bytes(nf4, QuantizedLinear) == elements // 2 + 4 * (elements // 64)
    assert _linear_bytes(nf4, QuantizedLinear) / dense == 9 / 64
    assert 0.25 < _linear_bytes(int8, QuantizedLinear) / dense <= 0.25 + 1 / 32  # in >= 32 here
    # Embeddings, norms and the LM head stay in float32.
    other = edl.nbytes(tiny_llama) - dense
    assert edl.nbytes(nf4) == other + _linear_bytes(nf4, QuantizedLinear)


def test_quantized_state_checkpoint_round_trip(tiny_llama, tmp_path):
    qmodel = quantize_model(tiny_llama, QuantConfig("int8", block_size=32))
    tx = optax.adamw(1e-3)
    state = edl.create_state(qmodel, tx)
    save_state(state, tmp_path)
    other = LlamaForCausalLM.init(tiny_llama.config, key=jax.random.key(5))
    like = edl.create_state(quantize_model(other, QuantConfig("int8", block_size=32)), tx)
    loaded, _ = load_state(tmp_path, like)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantize_errors_name_the_problem(tiny_llama):
    with pytest.raises(ValueError, match=r"matches none of the linear layers.*lm_head"):
        quantize_model(tiny_llama, QuantConfig(pattern="nothing"))
    qmodel = quantize_model(tiny_llama, QuantConfig("int8"))
    with pytest.raises(ValueError, match=r"q_proj.*QuantizedLinear.*not plain Linear"):
        quantize_model(qmodel, QuantConfig("int8"))
    with pytest.raises(ValueError, match="no QuantizedLinear"):
        dequantize_model(tiny_llama)
    with pytest.raises((ValueError, TypeError), match="int4"):  # TypeError: the test type hook
        QuantConfig("int4")
    with pytest.raises(ValueError, match="even"):
        quantize_model(tiny_llama, QuantConfig("nf4", block_size=7))
    with pytest.raises(ValueError, match="input features 3 != weight's 32"):
        jax.tree.map(lambda a: a[0], qmodel.model.layers.self_attn.q_proj)(jnp.ones((2, 3)))
