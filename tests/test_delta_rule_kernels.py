"""The gated delta rule's chunk-scan kernels, forward and backward: the Triton backward
(``edl.kernels.delta_rule_bwd``) and the Mosaic kernels (``edl.kernels.tpu.delta_rule``)
interpreted here against float64 autodiff of ``chunk_scan_xla`` (the recurrent form's
checks are tests/test_delta_rule.py's, whose kernel forms now differentiate through these
backwards); their lowering for cuda / tpu; the compiled Triton backward on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.kernels.delta_rule import XLA_SCAN_SCOPE, chunk_scan_xla, pallas_chunk_scan
from edl.kernels.delta_rule_bwd import chunk_scan_bwd
from edl.kernels.tpu.delta_rule import tpu_chunk_scan
from edl.ops.delta_rule import gated_delta_rule, recurrent_gated_delta_rule

ON_GPU = jax.default_backend() == "gpu"


def _scan_inputs(seed, b=2, h=2, n=3, c=4, dk=5, dv=3):
    """Random chunk-scan operands (float64): decays in (0, 1), a nonzero initial state, and
    cotangents of the output and of the final state."""
    ks = jax.random.split(jax.random.key(seed), 9)
    f = lambda k, *s: jax.random.normal(k, s, jnp.float64)
    args = (
        f(ks[0], b, h, n, c, dk),
        f(ks[1], b, h, n, c, dk),
        f(ks[2], b, h, n, c, dv),
        0.3 * f(ks[3], b, h, n, c, dk),
        f(ks[4], b, h, n, c, c),
        jax.nn.sigmoid(f(ks[5], b, h, n)),
        f(ks[6], b, h, dk, dv),
    )
    return args, (f(ks[7], b, h, n, c, dv), f(ks[8], b, h, dk, dv))


NAMES = ("qd", "kd", "u", "w", "attn", "decay", "state")


def _close(actual, expected, tol, names):
    for name, a, e in zip(names, actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=tol, atol=tol, err_msg=name)


# The Triton kernels interpreted compile slowly (~5 s each alone, ~17 s on the loaded 2-core
# VM): in the slow set, as tests/test_delta_rule.py's; the GPU run checks the compiled ones.
@pytest.mark.slow
def test_triton_backward_kernel_interpreted_matches_float64_autodiff_of_the_scan():
    with jax.enable_x64(True):
        args, cts = _scan_inputs(0, n=2)
        _, pullback = jax.vjp(chunk_scan_xla, *args)
        _close(chunk_scan_bwd(args, cts, interpret=True), pullback(cts), 1e-12, NAMES)


@pytest.mark.slow  # ~5 s
def test_interpreted_chunk_scan_differentiates_through_the_triton_backward_kernel(monkeypatch):
    """``pallas_chunk_scan(interpret=True)``'s vjp is the kernel's, not XLA's (checked by
    making the XLA vjp unreachable)."""
    import edl.kernels.delta_rule as module

    monkeypatch.setattr(module, "_xla_bwd", None)
    with jax.enable_x64(True):
        args, cts = _scan_inputs(2, b=1, n=2)
        _, pullback = jax.vjp(lambda *a: pallas_chunk_scan(*a, interpret=True), *args)
        _close(pullback(cts), jax.vjp(chunk_scan_xla, *args)[1](cts), 1e-12, NAMES)


# The Mosaic kernels interpreted, one program: ~4 s on the loaded 2-core VM; no GPU run
# covers them.
def test_tpu_kernels_interpreted_match_float64_autodiff_of_the_scan():
    with jax.enable_x64(True):
        args, cts = _scan_inputs(1, n=2)

        @jax.jit  # one program: the kernels' outputs and gradients, and the reference's
        def both(args, cts):
            kernel = lambda *a: tpu_chunk_scan(*a, interpret=True)
            runs = [jax.vjp(fn, *args) for fn in (kernel, chunk_scan_xla)]
            return [(out, pullback(cts)) for out, pullback in runs]

        (actual, kernel_grads), (expected, grads) = both(args, cts)
        _close(actual, expected, 1e-12, ("out", "final state"))
        _close(kernel_grads, grads, 1e-12, NAMES)


@pytest.mark.slow  # ~15 s: both kernels interpreted inside the whole chunked form
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_tpu_interpret"])
def test_kernel_forms_with_resets_match_float64_autodiff_of_the_recurrent_form(impl):
    """Packed segments, an initial state, random decays, 10 tokens in chunks of 64."""
    with jax.enable_x64(True):
        ks = jax.random.split(jax.random.key(3), 6)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        q = unit(jax.random.normal(ks[0], (1, 10, 2, 4), jnp.float64))
        k = unit(jax.random.normal(ks[1], (1, 10, 2, 4), jnp.float64))
        v = jax.random.normal(ks[2], (1, 10, 2, 3), jnp.float64)
        g = -jax.nn.softplus(jax.random.normal(ks[3], (1, 10, 2), jnp.float64))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, 10, 2), jnp.float64))
        s0 = jax.random.normal(ks[5], (1, 2, 4, 3), jnp.float64)
        resets = jnp.zeros((1, 10), bool).at[0, jnp.array([4, 7])].set(True)

        def grads(fn):
            loss = lambda *a: jnp.sum(jnp.sin(fn(*a)[0])) + jnp.sum(fn(*a)[1] ** 2)
            return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, s0)

        expected = grads(lambda *a: recurrent_gated_delta_rule(*a, resets))
        actual = grads(lambda *a: gated_delta_rule(*a, impl=impl, resets=resets))
        _close(actual, expected, 1e-9, ("q", "k", "v", "g", "beta", "state"))


def _lowered(platform, impl, seq=70, dk=8, dv=8):
    sh = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (sh(1, seq, 2, dk), sh(1, seq, 2, dk), sh(1, seq, 2, dv), sh(1, seq, 2), sh(1, seq, 2))

    def loss(*a):
        out, state = gated_delta_rule(*a, impl=impl)
        return jnp.sum(out) + jnp.sum(state)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return grad.trace(*args).lower(lowering_platforms=(platform,)).as_text(debug_info=True)


TPU_KERNELS = ("edl_tpu_delta_rule_fwd", "edl_tpu_delta_rule_fwd_states", "edl_tpu_delta_rule_bwd")


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_delta_rule_lowered_for_tpu_runs_mosaic_kernels_forward_and_backward(impl):
    text = _lowered("tpu", impl)
    assert text.count("tpu_custom_call") == 3 and "triton" not in text
    for name in TPU_KERNELS:
        assert name in text
    assert XLA_SCAN_SCOPE not in text, "an XLA scan of the delta rule in the TPU program"


def test_delta_rule_lowered_for_cuda_runs_the_triton_backward_and_cpu_the_xla_scan():
    text = _lowered("cuda", "auto")
    assert "edl_delta_rule_chunk_scan_bwd" in text and XLA_SCAN_SCOPE not in text
    assert XLA_SCAN_SCOPE in _lowered("cpu", "auto")  # CPU keeps the XLA scan and its vjp
    with pytest.raises(ValueError, match="runs on GPUs and TPUs only"):
        _lowered("cpu", "pallas")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize(("b", "h", "n", "dk", "dv"), [(1, 1, 1, 16, 16), (2, 4, 5, 128, 128)])
def test_compiled_triton_backward_matches_float64_autodiff_of_the_scan(b, h, n, dk, dv):
    """The compiled kernels (chunks of 64) against the float64 scan's vjp on the CPU. Raw
    operands (not from ``chunk_inputs``): errors relative to the largest gradient, 1e-2
    (float32 matmuls, TF32 where Triton chooses it, over a state that grows chunk by
    chunk)."""
    with jax.enable_x64(True):
        args, cts = _scan_inputs(4, b, h, n, 64, dk, dv)
        args = (*args[:3], args[3] * 0.1, args[4] * 0.1, *args[5:])
        args64, cts64 = (tuple(np.asarray(x) for x in xs) for xs in (args, cts))
        pullback = lambda a, c: jax.vjp(chunk_scan_xla, *a)[1](c)
        expected = jax.jit(pullback, backend="cpu")(args64, cts64)
    to32 = lambda xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)
    kernel = lambda a, c: jax.vjp(lambda *x: pallas_chunk_scan(*x), *a)[1](c)
    actual = jax.jit(kernel)(to32(args64), to32(cts64))
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        e = np.asarray(e)
        err = np.max(np.abs(np.asarray(a, np.float64) - e)) / max(1.0, np.abs(e).max())
        assert err < 1e-2, (name, err)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_compiled_delta_rule_gradients_with_resets_match_the_float64_recurrent_form():
    """Triton forward and backward through the whole chunked form, packed sequences."""
    ks = jax.random.split(jax.random.key(9), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (2, 150, 4, 64)))
    k = unit(jax.random.normal(ks[1], (2, 150, 4, 64)))
    v = jax.random.normal(ks[2], (2, 150, 4, 32))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, 150, 4)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, 150, 4)))
    s0 = jax.random.normal(ks[5], (2, 4, 64, 32))
    resets = np.zeros((2, 150), bool)
    resets[0, [30, 64]] = resets[1, [100]] = True
    args32 = (q, k, v, g, beta, s0)

    def grads(fn):  # resets, the last argument, not differentiated
        loss = lambda *a: jnp.sum(jnp.sin(fn(*a)[0])) + jnp.sum(fn(*a)[1] ** 2)
        return jax.grad(loss, argnums=tuple(range(6)))

    with jax.enable_x64(True):
        args64 = tuple(np.asarray(x, np.float64) for x in args32)
        reference = lambda *a: recurrent_gated_delta_rule(*a)
        expected = jax.jit(grads(reference), backend="cpu")(*args64, resets)
    kernel = lambda *a: gated_delta_rule(*a[:-1], impl="pallas", resets=a[-1])
    actual = jax.jit(grads(kernel))(*args32, jnp.asarray(resets))
    for name, a, e in zip(("q", "k", "v", "g", "beta", "state"), actual, expected, strict=True):
        e = np.asarray(e)
        err = np.max(np.abs(np.asarray(a, np.float64) - e)) / max(1.0, np.abs(e).max())
        assert err < 2e-3, (name, err)
