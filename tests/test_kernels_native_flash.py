"""edl.kernels.native.flash_attention_cpu: the C++ attention for CPU training, forward and
backward, against the float64 oracle of test_kernels_attention.py; and how
edl.ops.attention picks it.

Tolerances: float32 sums over at most ~200 keys in a different order from the oracle (errors
seen ~1e-6, bound 2e-5); bfloat16 operands are compared with the oracle on the same rounded
inputs, outputs and gradients rounded to bfloat16 (a few units of 2^-8 relative to the
largest entry): 2e-2.
"""

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P
from test_kernels_attention import _float64_reference, _inputs, _rel_err, _segments

from edl import ops
from edl.kernels import native

platforms = __import__("edl.platforms", fromlist=["_noticed"])

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is CPU-only"),
    pytest.mark.skipif(
        native.unavailable() is not None, reason=f"native kernel: {native.unavailable()}"
    ),
]


def _native(q, k, v, d_out, *, segment_ids=None, impl="native", **kw):
    """Output and (dq, dk, dv) for cotangent ``d_out`` through ``ops.attention``, jitted."""

    @jax.jit
    def run(q, k, v, d_out, segment_ids):
        fn = functools.partial(ops.attention, segment_ids=segment_ids, impl=impl, **kw)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return run(q, k, v, d_out, segment_ids)


def _assert_matches_float64(q, k, v, d_out, tol, segment_ids=None, **kw):
    out, grads = _native(q, k, v, d_out, segment_ids=segment_ids, **kw)
    ref_out, ref_grads = _float64_reference(q, k, v, d_out, segment_ids=segment_ids, **kw)
    for name, actual, expected in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert actual.dtype == q.dtype and actual.shape == expected.shape, name
        assert not bool(jnp.isnan(actual).any()), name
        err = _rel_err(actual, expected)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} ({kw})"


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    causal = draw(st.booleans())
    return {
        "batch": draw(st.integers(1, 3)),
        "q_len": draw(st.integers(1, 150)),
        "kv_len": draw(st.integers(1, 200)),
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([8, 24, 32, 80])),
        "causal": causal,
        "window": draw(st.none() | st.integers(1, 90)) if causal else None,
        "softcap": draw(st.none() | st.floats(1.0, 5.0)),
        "scale": draw(st.none() | st.floats(0.05, 0.5)),
        "segments": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _check_native(c):
    """Random GQA shapes, lengths that are and are not whole blocks of 64, q_len above and
    below kv_len, causal or not, windows, soft-caps, scales, and segments that leave some
    queries without any key (zero output, zero gradients)."""
    shape = (c["batch"], c["q_len"], c["kv_len"], c["heads"], c["kv_heads"], c["head_dim"])
    q, k, v, d_out = _inputs(c["seed"], *shape)
    segments = _segments(c["seed"], c["batch"], c["q_len"], c["kv_len"]) if c["segments"] else None
    _assert_matches_float64(
        q,
        k,
        v,
        d_out,
        2e-5,
        segment_ids=segments,
        causal=c["causal"],
        window=c["window"],
        softcap=c["softcap"],
        scale=c["scale"],
    )


@settings(max_examples=15, deadline=None)  # ~0.3 s an example; broadly: slow
@given(cases())
def test_forward_and_gradients_match_float64(c):
    _check_native(c)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(cases())
def test_forward_and_gradients_match_float64_broadly(c):
    _check_native(c)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim):
    q, k, v, d_out = _inputs(3, 2, 130, 130, 4, 2, head_dim)
    _assert_matches_float64(q, k, v, d_out, 2e-5, causal=True)


def test_bfloat16_accumulates_in_float32():
    q, k, v, d_out = _inputs(4, 2, 200, 200, 8, 4, 32, dtype=jnp.bfloat16)
    segments = _segments(4, 2, 200, 200)
    _assert_matches_float64(q, k, v, d_out, 2e-2, causal=True, segment_ids=segments)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v, d_out = _inputs(5, 1, 70, 70, 2, 1, 16)
    q_ids = jnp.full((1, 70), 2, jnp.int32).at[0, :40].set(1)
    kv_ids = jnp.ones((1, 70), jnp.int32)  # no key of segment 2: queries 40.. see nothing
    out, (dq, dk, dv) = _native(q, k, v, d_out, segment_ids=(q_ids, kv_ids), causal=True)
    assert bool(jnp.all(out[0, 40:] == 0)) and bool(jnp.all(dq[0, 40:] == 0))
    assert bool(jnp.any(out[0, :40] != 0)) and not bool(jnp.isnan(dk).any() | jnp.isnan(dv).any())


def test_auto_picks_native_on_cpu_for_float32_and_bfloat16_only():
    q, k, v, _ = _inputs(6, 1, 16, 16, 4, 2, 8)

    def jaxpr(q, k, v):
        loss = lambda q, k, v: ops.attention(q, k, v, causal=True).sum()
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))

    assert "edl_flash_attention_forward" in jaxpr(q, k, v)
    assert "edl_flash_attention_backward" in jaxpr(q, k, v)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert "edl_flash_attention_backward" in jaxpr(*bf16)
    f16 = [x.astype(jnp.float16) for x in (q, k, v)]
    assert "edl_flash_attention_forward" not in jaxpr(*f16)  # Pallas: it takes float16
    with pytest.raises(ValueError, match=r"impl='native' cannot run: .*float16"):
        ops.attention(*f16, impl="native")


def test_without_the_kernel_auto_falls_back_to_pallas_with_one_warning(monkeypatch):
    q, k, v, d_out = _inputs(7, 1, 24, 24, 2, 1, 8)
    monkeypatch.setattr(native, "unavailable", lambda: "no C++ compiler found (test)")
    monkeypatch.setattr(platforms, "_noticed", set())
    with pytest.warns(UserWarning, match=r"no C\+\+ compiler found \(test\); using impl='pallas'"):
        out = ops.attention(q, k, v, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        ops.attention(q, k, v, causal=True)
    ref_out, _ = _float64_reference(q, k, v, d_out, causal=True)
    assert _rel_err(out, ref_out) < 2e-5
    with pytest.raises(ValueError, match=r"impl='native' cannot run: no C\+\+ compiler"):
        ops.attention(q, k, v, impl="native")


def test_under_a_mesh_and_vmap():
    """Under ``jax.set_mesh`` the kernel runs once per batch shard (shard_map); under vmap
    once per mapped element. Both equal the unsharded, unmapped result."""
    q, k, v, d_out = _inputs(8, 8, 40, 40, 4, 2, 16)
    plain_out, plain_grads = _native(q, k, v, d_out, causal=True)
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        shard = lambda x: jax.device_put(x, P("dp"))
        out, grads = _native(*map(shard, (q, k, v, d_out)), causal=True)
    for actual, expected in zip((out, *grads), (plain_out, *plain_grads), strict=True):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=0, atol=1e-6)
    stacked = jax.vmap(functools.partial(ops.attention, causal=True, impl="native"))(
        q.reshape(2, 4, 40, 4, 16), k.reshape(2, 4, 40, 2, 16), v.reshape(2, 4, 40, 2, 16)
    )
    np.testing.assert_allclose(
        np.asarray(stacked.reshape(q.shape)), np.asarray(plain_out), rtol=0, atol=1e-6
    )


def test_bad_inputs_name_the_problem():
    q, k, v, _ = _inputs(9, 1, 8, 8, 2, 1, 8)
    with pytest.raises(ValueError, match="share float32 or bfloat16, got float32, bfloat16"):
        native.flash_attention_cpu(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids or neither"):
        native.flash_attention_cpu(q, k, v, q_segment_ids=jnp.ones((1, 8), jnp.int32))


_CHECK_BUILD = """
import json, jax, jax.numpy as jnp, numpy as np
from edl import ops
from edl.kernels import native
assert native.unavailable() is None, native.unavailable()
rng = np.random.default_rng(0)
q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                  for s in ((2, 80, 4, 40), (2, 80, 2, 40), (2, 80, 2, 40), (2, 80, 4, 40)))
def grads(impl):
    fn = lambda q, k, v: ops.attention(q, k, v, causal=True, impl=impl)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))
errors = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads("native"), grads("xla"))]
print(json.dumps(errors))
"""


def _has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512f" in cpuinfo.read_text()


@pytest.mark.slow  # builds and loads a second variant of the kernel (~9 s)
@pytest.mark.skipif(not _has_avx512(), reason="the default build already is the 8-float one")
def test_the_eight_float_build_for_cpus_without_avx512(tmp_path):
    # The kernel's vector width follows the target (16 floats with AVX-512, 8 elsewhere); this
    # machine's default build takes the 16-float path, so build the other one here, in a
    # process of its own (one library per process), with its own cache directory.
    env = {**os.environ, "EDL_NATIVE_CXXFLAGS": "-mno-avx512f", "EDL_KERNEL_CACHE": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHECK_BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    # float32 against XLA's float32 attention over <= 80 keys: ~1e-6 seen.
    assert max(errors) < 2e-5, errors
    assert list(tmp_path.glob("edl_native-*.so")), "the build landed elsewhere"
