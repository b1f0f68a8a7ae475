"""edl.kernels (flash and decode attention, interpret mode on CPU) against float64 references.

Forward outputs and all three gradients are compared with a float64 numpy evaluation of the
plain reference and of its gradients (``_float64_reference``, itself checked against jax
autodiff of ``reference_attention`` in float64); decode attention with an explicit float64
numpy loop. Tolerances: errors are measured relative to max(1, max |expected|). float32
kernels accumulate in float32 over at most ~100 keys here, so 2e-5 leaves a margin of ~10x
over the errors seen (~1e-6); 16-bit inputs are compared on the same rounded inputs, and the
kernel rounds P to the input dtype before ``P @ V`` (as every flash kernel does), so the bound
is a few units of bf16's 2^-8 resolution: 3e-2.

Every kernel call is jitted whole: run eagerly, each op around the kernel compiles on its own,
several times the cost of compiling one program.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl.kernels import BlockSizes, flash_attention
from edl.kernels.decode_attention import decode_attention
from edl.kernels.flash_attention import _backward, _FlashPlan, _forward
from edl.ops.attention import reference_attention

# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu
# The shapes a GPU's kernels take (Triton's blocks) differ from those interpreted on a CPU.
ON_GPU = jax.default_backend() == "gpu"


def _rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(
        np.max(np.abs(actual - expected), initial=0.0) / max(1.0, np.abs(expected).max(initial=0.0))
    )


def _inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32):
    """Unit-normal q, k, v and a cotangent for the output. Drawn with numpy: jax.random would
    compile a sampler for every new shape."""
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    return tuple(
        jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
        for shape in (q_shape, kv_shape, kv_shape, q_shape)
    )


def _segments(seed, batch, q_len, kv_len):
    """Sorted ids in {0, 1, 2} drawn separately for q and kv: some queries see no key."""
    rng = np.random.default_rng(seed + 1)
    q_ids = np.sort(rng.integers(0, 3, (batch, q_len), np.int32), axis=1)
    kv_ids = np.sort(rng.integers(0, 3, (batch, kv_len), np.int32), axis=1)
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def _float64_reference(
    q, k, v, d_out, *, causal=False, segment_ids=None, window=None, softcap=None, scale=None
):
    """Output and (dq, dk, dv) of the plain reference (``reference_attention``) in
    float64 numpy: the forward as defined, the backward by the chain rule through P @ V, the
    masked softmax, the soft-cap and the scaled Q K^T (rows that see no key: zero output and
    zero gradients). Numpy, not jax: jax would compile a float64 program per shape."""
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    q_pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    k_pos = np.arange(kv_len)[None, :]
    mask = np.ones((1, q_len, kv_len), bool)
    if causal or window is not None:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    if segment_ids is not None:
        q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
        mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])
    mask = mask[:, None, None]  # (batch | 1, 1, 1, q_len, kv_len)
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim)
    d_out = d_out.reshape(qg.shape)
    logits = np.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    capped = logits if softcap is None else softcap * np.tanh(logits / softcap)
    masked = np.where(mask, capped, -np.inf)
    row_max = masked.max(axis=-1, keepdims=True)
    weights = np.exp(masked - np.where(np.isfinite(row_max), row_max, 0.0))
    denom = weights.sum(axis=-1, keepdims=True)
    probs = weights / np.where(denom == 0, 1.0, denom)  # masked entries and empty rows: 0
    out = np.einsum("bhgqk,bkhd->bqhgd", probs, v)
    dv = np.einsum("bhgqk,bqhgd->bkhd", probs, d_out)
    d_probs = np.einsum("bqhgd,bkhd->bhgqk", d_out, v)
    d_capped = probs * (d_probs - np.sum(probs * d_probs, axis=-1, keepdims=True))
    d_logits = d_capped if softcap is None else d_capped * (1 - np.tanh(logits / softcap) ** 2)
    dq = np.einsum("bhgqk,bkhd->bqhgd", d_logits, k) * scale
    dk = np.einsum("bhgqk,bqhgd->bkhd", d_logits, qg) * scale
    return out.reshape(q.shape), [dq.reshape(q.shape), dk, dv]


def test_float64_reference_is_autodiff_of_the_plain_reference():
    """The numpy oracle above against jax autodiff of ``reference_attention`` in float64
    (whose logits are float32, hence 1e-5), on a case with GQA, q_len < kv_len, a window, a
    soft-cap, a scale and segments that leave some queries without any key."""
    q, k, v, d_out = _inputs(7, 2, 13, 19, 6, 2, 8)
    segments = _segments(7, 2, 13, 19)
    kw = dict(causal=True, window=6, softcap=2.5, scale=0.4)
    # On the CPU: a GPU's cuBLAS may have no float64 GEMM (jax 0.11.2 with CUDA 13 has none).
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, d_out)]

        @jax.jit
        def autodiff(q, k, v, d_out, segment_ids):
            fn = functools.partial(reference_attention, segment_ids=segment_ids, **kw)
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(d_out)

        out, grads = autodiff(*args, segments)
    ref_out, ref_grads = _float64_reference(q, k, v, d_out, segment_ids=segments, **kw)
    assert np.any(np.all(ref_out == 0, axis=(2, 3)))  # some queries see no key
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert _rel_err(actual, expected) < 1e-5, name


def _kernel(q, k, v, d_out, *, segment_ids=None, block_sizes=None, **kw):
    """The kernel's output and (dq, dk, dv) for cotangent ``d_out``, as one compiled program."""

    @jax.jit
    def run(q, k, v, d_out, segment_ids):
        q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
        fn = functools.partial(
            flash_attention,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            block_sizes=block_sizes,
            **kw,
        )
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return run(q, k, v, d_out, segment_ids)


def _assert_close(q, k, v, d_out, tol, segment_ids=None, block_sizes=None, **kw):
    out, grads = _kernel(q, k, v, d_out, segment_ids=segment_ids, block_sizes=block_sizes, **kw)
    ref_out, ref_grads = _float64_reference(q, k, v, d_out, segment_ids=segment_ids, **kw)
    assert not any(bool(jnp.isnan(x).any()) for x in (out, *grads))
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert actual.dtype == q.dtype, name
        err = _rel_err(actual, expected)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} ({kw})"


@st.composite
def flash_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    return {
        "batch": draw(st.integers(1, 2)),
        "q_len": draw(st.integers(1, 40)),
        "kv_len": draw(st.integers(1, 40)),
        "heads": kv_heads * draw(st.sampled_from([1, 2, 3])),
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8, 16])),
        "causal": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "scale": draw(st.none() | st.floats(0.1, 1.0)),
        "segments": draw(st.booleans()),
        # Small, unequal blocks: several blocks per sequence, lengths rarely a multiple.
        "blocks": BlockSizes(*(draw(st.sampled_from([4, 8, 16])) for _ in range(4))),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _check_flash(c):
    shape = {k: c[k] for k in ("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim")}
    q, k, v, d_out = _inputs(c["seed"], **shape)
    segments = _segments(c["seed"], c["batch"], c["q_len"], c["kv_len"]) if c["segments"] else None
    _assert_close(
        q,
        k,
        v,
        d_out,
        2e-5,
        segment_ids=segments,
        block_sizes=c["blocks"],
        causal=c["causal"],
        window=c["window"],
        softcap=c["softcap"],
        scale=c["scale"],
    )


@settings(max_examples=6)  # every example compiles three kernels for new shapes; broadly: slow
@given(flash_cases())
def test_flash_attention_forward_and_gradients_match_float64(c):
    _check_flash(c)


@pytest.mark.slow
@settings(max_examples=30)
@given(flash_cases())
def test_flash_attention_forward_and_gradients_match_float64_broadly(c):
    _check_flash(c)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_flash_attention_head_dims(head_dim):
    q, k, v, d_out = _inputs(0, 1, 33, 50, 4, 2, head_dim)
    _assert_close(q, k, v, d_out, 2e-5, block_sizes=BlockSizes(16, 16, 16, 16), causal=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_flash_attention_16bit_inputs_accumulate_in_float32(dtype):
    q, k, v, d_out = _inputs(1, 2, 70, 70, 4, 1, 32, dtype)
    _assert_close(q, k, v, d_out, 3e-2, block_sizes=BlockSizes(32, 16, 16, 32), causal=True)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v, d_out = _inputs(2, 1, 8, 8, 2, 1, 8)
    q_ids = jnp.array([[1, 1, 1, 1, 2, 2, 3, 3]])
    kv_ids = jnp.array([[1, 1, 2, 2, 2, 2, 2, 2]])  # queries of segment 3 see nothing
    out, (dq, _, _) = _kernel(q, k, v, d_out, segment_ids=(q_ids, kv_ids), causal=True)
    assert not bool(jnp.isnan(out).any() | jnp.isnan(dq).any())
    np.testing.assert_array_equal(out[0, 6:], 0.0)
    np.testing.assert_array_equal(dq[0, 6:], 0.0)
    assert bool(jnp.all(jnp.any(out[0, :6] != 0, axis=(-1, -2))))


def test_interpret_mode_poisons_unwritten_outputs():
    """The premise of the next test: Pallas' interpreter starts outputs as NaN."""
    from jax.experimental import pallas as pl

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    x = jnp.zeros((8, 8), jnp.float32)
    out = pl.pallas_call(writes_nothing, out_shape=x, interpret=True)(x)
    assert bool(jnp.isnan(out).all())


def test_every_output_element_is_written():
    """Run the padded kernels directly: every element of every output (padding rows, the
    log-sum-exp, dq, dk, dv) must be finite, so no block was skipped unwritten, including
    K/V blocks no query sees under a sliding window."""
    q, k, v, d_out = _inputs(3, 2, 24, 40, 4, 2, 8)
    plan = _FlashPlan(
        causal=True,
        window=5,
        softcap=None,
        scale=0.3,
        q_len=21,
        kv_len=37,
        padded_q=24,
        padded_kv=40,
        block_q=8,
        block_k=8,
        block_q_bwd=8,
        block_k_bwd=8,
        blocks=BlockSizes(8, 8, 8, 8),
        interpret=True,
    )
    q_ids, kv_ids = _segments(3, 2, 24, 40)
    out, lse = jax.jit(_forward, static_argnums=5)(q, k, v, q_ids, kv_ids, plan)
    grads = jax.jit(_backward, static_argnums=8)(q, k, v, q_ids, kv_ids, out, lse, d_out, plan)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), strict=True):
        assert bool(jnp.isfinite(x).all()), name


def _numpy_decode(q, k, v, lengths, kv_start, window, softcap, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, new, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    keys = np.arange(k.shape[1])
    for b in range(batch):
        for t in range(new):
            pos = lengths[b] - new + t
            seen = (keys <= pos) & (keys < lengths[b]) & (keys >= kv_start[b])
            if window is not None:
                seen &= pos - keys < window
            if not seen.any():
                continue
            for h in range(heads):
                s = k[b, :, h // group] @ q[b, t, h] * scale
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(np.where(seen, s, -np.inf) - s[seen].max())
                out[b, t, h] = p @ v[b, :, h // group] / p.sum()
    return out


@st.composite
def decode_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    # Triton's key blocks are powers of two >= 16, so a GPU's caches are multiples of 16.
    cache_len = draw(st.sampled_from([16, 32, 48, 64] if ON_GPU else [16, 24, 40, 64]))
    new = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 3))
    lengths = [draw(st.integers(new, cache_len)) for _ in range(batch)]
    return {
        "batch": batch,
        "new": new,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "kv_heads": kv_heads,
        "cache_len": cache_len,
        "lengths": lengths,
        "kv_start": [draw(st.integers(0, n)) for n in lengths] if draw(st.booleans()) else None,
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "block_k": draw(st.sampled_from([None, 4, 8])),
        "num_splits": draw(st.sampled_from([None, 1, 2, 3])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


# One compiled program per call (the static arguments differ between examples anyway).
_decode = jax.jit(decode_attention, static_argnames=("window", "softcap", "block_k", "num_splits"))


@settings(max_examples=8)  # every example compiles a kernel for new shapes
@given(decode_cases())
def test_decode_attention_matches_float64(c):
    q, k, v, _ = _inputs(
        c["seed"], c["batch"], c["new"], c["cache_len"], c["heads"], c["kv_heads"], 8
    )
    lengths = jnp.asarray(c["lengths"], jnp.int32)
    start = None if c["kv_start"] is None else jnp.asarray(c["kv_start"], jnp.int32)
    out = _decode(
        q,
        k,
        v,
        lengths,
        kv_start=start,
        window=c["window"],
        softcap=c["softcap"],
        block_k=c["block_k"],
        num_splits=c["num_splits"],
    )
    expected = _numpy_decode(
        q,
        k,
        v,
        c["lengths"],
        c["kv_start"] or [0] * c["batch"],
        c["window"],
        c["softcap"],
        8**-0.5,
    )
    assert not bool(jnp.isnan(out).any())
    assert _rel_err(out, expected) < 2e-5


def test_decode_attention_equals_flash_attention_on_the_valid_prefix():
    """One row whose cache holds exactly ``length`` keys: the last ``new`` queries of a full
    causal pass are what decode computes."""
    q, k, v, _ = _inputs(5, 1, 3, 48, 8, 2, 16)
    cache = jnp.zeros((1, 64, 2, 16), jnp.float32)
    k_cache, v_cache = cache.at[:, :48].set(k), cache.at[:, :48].set(v)
    out = decode_attention(q, k_cache, v_cache, jnp.array([48]), block_k=16, num_splits=2)
    np.testing.assert_allclose(out, flash_attention(q, k, v, causal=True), atol=2e-6)


def test_decode_attention_errors_name_the_problem():
    q = jnp.zeros((2, 1, 4, 8))
    cache = jnp.zeros((2, 100, 2, 8))
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \(2,\)"):
        decode_attention(q, cache, cache, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="cache length \\(100\\) must be a multiple of 16"):
        decode_attention(q, cache, cache, jnp.array([1, 2]), interpret=False)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        decode_attention(q, cache.astype(jnp.bfloat16), cache, jnp.array([1, 2]))


def test_flash_attention_errors_name_the_problem():
    q = jnp.zeros((1, 4, 4, 8))
    with pytest.raises(ValueError, match="4 heads not a multiple of 3 kv heads"):
        flash_attention(q, jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 3, 8)))
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
        flash_attention(q, q, q, q_segment_ids=jnp.zeros((1, 4), jnp.int32))


def _lower_for_gpu(fn, *shapes):
    """Lower ``fn`` for CUDA from this CPU-only machine: Pallas emits the Triton IR here."""
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    ("head_dim", "dtype", "group", "kw"),
    [
        (64, jnp.bfloat16, 1, {"causal": False}),
        (128, jnp.bfloat16, 4, {"causal": True, "window": 256, "softcap": 30.0}),
        (256, jnp.float16, 3, {"causal": True}),
        (80, jnp.float32, 2, {"causal": False}),  # head_dim padded to 128 for Triton
    ],
)
def test_flash_attention_lowers_to_triton(head_dim, dtype, group, kw):
    def loss(q, k, v, ids):
        out = flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, interpret=False, **kw)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 300, 2 * group, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 300, 2, head_dim), dtype)
    ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    text = _lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids)
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_decode_attention_lowers_to_triton():
    def run(q, k, v, lengths, start):
        return decode_attention(q, k, v, lengths, kv_start=start, window=128, interpret=False)

    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    assert _lower_for_gpu(run, q, cache, cache, lengths, lengths).count("__gpu$xla.gpu.triton") == 1
