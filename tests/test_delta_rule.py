"""The gated delta rule (``edl.ops.delta_rule``, ``edl.kernels.delta_rule``): the chunked form
and the Pallas chunk scan (interpreted here, compiled on GPU) against the float64 recurrent
reference, forward and gradients; the decode step; transformers' torch implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from edl.kernels.delta_rule import pallas_chunk_scan
from edl.ops.delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    gated_delta_step,
    recurrent_gated_delta_rule,
)

ON_GPU = jax.default_backend() == "gpu"
# Each example compiles a few programs: shrinking a failure would take minutes.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _inputs(seed, batch, seq, heads, dk, dv, dtype=jnp.float64, with_state=True):
    ks = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (batch, seq, heads, dk), dtype))
    k = unit(jax.random.normal(ks[1], (batch, seq, heads, dk), dtype))
    v = jax.random.normal(ks[2], (batch, seq, heads, dv), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (batch, seq, heads), dtype))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, seq, heads), dtype))
    s0 = jax.random.normal(ks[5], (batch, heads, dk, dv), dtype) if with_state else None
    return q, k, v, g, beta, s0


def _interpreted(*args, chunk):
    scan = lambda *a: pallas_chunk_scan(*a, interpret=True)
    return chunked_gated_delta_rule(*args, chunk=chunk, scan=scan)


FORMS = {
    "chunked": lambda *a, chunk: chunked_gated_delta_rule(*a, chunk=chunk),
    "pallas_interpret": _interpreted,
}


@pytest.mark.slow  # ~70 s per form on the shared 2-core VM (a compile per example)
@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=6, deadline=None, phases=NO_SHRINK)
@given(
    seq=st.integers(1, 40),
    heads=st.integers(1, 3),
    chunk=st.sampled_from([4, 8, 16]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_forms_match_the_recurrent_reference_in_float64(
    form, seq, heads, chunk, with_state, seed
):
    with jax.enable_x64(True):
        args = _inputs(seed, 2, seq, heads, 6, 5, with_state=with_state)
        out_ref, state_ref = recurrent_gated_delta_rule(*args)
        out, state = FORMS[form](*args, chunk=chunk)
        np.testing.assert_allclose(out, out_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(state, state_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.slow  # ~60 s per form
@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=4, deadline=None, phases=NO_SHRINK)
@given(seq=st.integers(1, 20), chunk=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_chunked_gradients_match_autodiff_of_the_reference(form, seq, chunk, seed):
    with jax.enable_x64(True):
        args = _inputs(seed, 1, seq, 2, 4, 3)
        weights = jax.random.normal(jax.random.key(seed + 1), (1, seq, 2, 3), jnp.float64)

        def loss(fn):
            def f(*a):
                out, state = fn(*a)
                return jnp.sum(out * weights) + jnp.sum(jnp.sin(state))

            return jax.grad(f, argnums=tuple(range(6)))

        expected = loss(recurrent_gated_delta_rule)(*args)
        actual = loss(lambda *a: FORMS[form](*a, chunk=chunk))(*args)
        for name, a, e in zip(("q", "k", "v", "g", "beta", "state"), actual, expected, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-9, err_msg=name)


# The interpreted kernel (~10 s) in the slow set; the GPU run checks the compiled one.
@pytest.mark.parametrize(
    "form", [f if f == "chunked" else pytest.param(f, marks=pytest.mark.slow) for f in FORMS]
)
def test_one_uneven_length_with_a_state_matches_the_reference_forward_and_backward(form):
    """The default suite's one case of the slow property tests above: 11 tokens in chunks
    of 4, two heads, an initial state."""
    with jax.enable_x64(True):
        args = _inputs(11, 1, 11, 2, 4, 3)
        out_ref, state_ref = recurrent_gated_delta_rule(*args)
        out, state = FORMS[form](*args, chunk=4)
        np.testing.assert_allclose(out, out_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(state, state_ref, rtol=1e-10, atol=1e-10)
        loss = lambda fn: jax.grad(
            lambda *a: jnp.sum(jnp.sin(fn(*a)[0])) + jnp.sum(fn(*a)[1] ** 2), argnums=(0, 4, 5)
        )
        expected = loss(recurrent_gated_delta_rule)(*args)
        actual = loss(lambda *a: FORMS[form](*a, chunk=4))(*args)
        for a, e in zip(actual, expected, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-9)


def _alone(args, lengths):
    """Each segment of ``lengths`` through the reference alone (the first continues the
    initial state, the others start from zeros): outputs concatenated, the last's state."""
    q, k, v, g, beta, s0 = args
    outs, start, state = [], 0, s0
    for n in lengths:
        part = [x[:, start : start + n] for x in (q, k, v, g, beta)]
        out, state = recurrent_gated_delta_rule(*part, state if start == 0 else None)
        outs.append(out)
        start += n
    return jnp.concatenate(outs, axis=1), state


# Segments of 3, 5 and 5 tokens in chunks of 4: resets inside a chunk and on its boundary.
@pytest.mark.parametrize(
    "form", [f if f == "chunked" else pytest.param(f, marks=pytest.mark.slow) for f in FORMS]
)
def test_resets_run_each_packed_segment_as_alone_forward_and_backward(form):
    lengths = (3, 5, 5)
    resets = np.zeros((1, sum(lengths)), bool)
    resets[0, np.cumsum(lengths)[:-1]] = True
    resets = jnp.asarray(resets)
    with jax.enable_x64(True):
        args = _inputs(5, 1, sum(lengths), 2, 4, 3)
        out_ref, state_ref = _alone(args, lengths)

        @jax.jit  # outputs and the gradients of sum(sin(out)) + sum(state^2): one program
        def run(fn, *a):
            (out, state), vjp = jax.vjp(lambda *a: fn(*a, resets), *a)
            return out, state, vjp((jnp.cos(out), 2 * state))

        chunked = jax.tree_util.Partial(lambda *a: FORMS[form](*a[:-1], a[-1], chunk=4))
        out, state, actual = run(chunked, *args)
        np.testing.assert_allclose(out, out_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(state, state_ref, rtol=1e-10, atol=1e-10)
        out, _, expected = run(jax.tree_util.Partial(recurrent_gated_delta_rule), *args)
        np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-12)
        for a, e in zip(actual, expected, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # ~10 s; test_models_qwen3_next's greedy generation decodes by default
def test_decode_steps_continue_a_chunked_prefill():
    with jax.enable_x64(True):
        q, k, v, g, beta, s0 = _inputs(3, 2, 13, 2, 4, 4)
        out_ref, state_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
        _, state = chunked_gated_delta_rule(*(x[:, :10] for x in (q, k, v, g, beta)), s0, chunk=4)
        for t in range(10, 13):
            out, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            np.testing.assert_allclose(out, out_ref[:, t], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(state, state_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # ~13 s; the model's logits against transformers run by default
def test_matches_transformers_chunked_delta_rule():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, s0 = _inputs(5, 2, 70, 2, 8, 6, dtype=jnp.float32)
    t = lambda x: torch.from_numpy(np.array(x))
    out_hf, state_hf = hf.torch_chunk_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(s0), output_final_state=True
    )
    out, state = gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(out, out_hf.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, state_hf.numpy(), rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_refuses_unknown_impls():
    q, k, v, g, beta, _ = _inputs(0, 1, 4, 2, 4, 4, dtype=jnp.float32, with_state=False)
    with pytest.raises(ValueError, match="impl must be one of"):
        gated_delta_rule(q, k, v, g, beta, impl="flash")


def _lower_for(platform, fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _shapes(seq, dk, dv):
    sh = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return sh(1, seq, 2, dk), sh(1, seq, 2, dk), sh(1, seq, 2, dv), sh(1, seq, 2), sh(1, seq, 2)


@pytest.mark.parametrize(("dk", "dv"), [(16, 32), (5, 7), (128, 128)])
def test_pallas_delta_rule_lowers_to_one_triton_kernel(dk, dv):
    def run(*a):
        out, state = gated_delta_rule(*a, impl="pallas")
        return jnp.sum(out) + jnp.sum(state)

    args = _shapes(100, dk, dv)
    assert _lower_for("cuda", run, *args).count("__gpu$xla.gpu.triton") == 1
    # Differentiated: the forward kernel, then the backward's two (the states recomputed,
    # the reverse scan); no XLA scan of the delta rule left.
    grad = jax.value_and_grad(run, argnums=(0, 1, 2, 3, 4))
    text = _lower_for("cuda", grad, *args)
    assert text.count("__gpu$xla.gpu.triton") == 3
    assert "edl_delta_rule_chunk_scan_states" in text and "edl_delta_rule_chunk_scan_bwd" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize(("seq", "dk", "dv"), [(1, 16, 16), (200, 128, 128), (130, 64, 32)])
def test_pallas_delta_rule_on_gpu_matches_the_float64_reference(seq, dk, dv):
    args32 = _inputs(7, 2, seq, 4, dk, dv, dtype=jnp.float32)
    with jax.enable_x64(True):
        args64 = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in args32)
        out_ref, state_ref = jax.jit(recurrent_gated_delta_rule, backend="cpu")(*args64)
    out, state = jax.jit(lambda *a: gated_delta_rule(*a, impl="pallas"))(*args32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(np.asarray(state), np.asarray(state_ref), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_pallas_delta_rule_with_resets_on_gpu_matches_the_float64_reference():
    """Packed segments (resets inside chunks of 64 and on a boundary) through the kernel."""
    args32 = _inputs(8, 2, 200, 4, 64, 32, dtype=jnp.float32)
    resets = np.zeros((2, 200), bool)
    resets[0, [30, 64, 150]] = resets[1, [1, 128]] = True
    with jax.enable_x64(True):
        args64 = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in args32)
        reference = jax.jit(recurrent_gated_delta_rule, backend="cpu")
        out_ref, state_ref = reference(*args64, jnp.asarray(resets))
    run = jax.jit(lambda *a: gated_delta_rule(*a[:-1], impl="pallas", resets=a[-1]))
    out, state = run(*args32, jnp.asarray(resets))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(np.asarray(state), np.asarray(state_ref), rtol=2e-3, atol=2e-3)
