"""edl.ops.matmul: both ways of computing ``x @ W.T`` against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edl.ops import linear
from edl.ops.matmul import SMALL_ROWS

# float32 sums of <= 96 products of N(0, 1) x N(0, 0.5) terms: the error is a few ulps of
# the largest partial sum (|.| <~ 30), so 1e-5 absolute + relative leaves a wide margin.
TOL = dict(rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=25)
@given(
    batch=st.lists(st.integers(1, 12), min_size=0, max_size=3),
    features=st.tuples(st.integers(1, 96), st.integers(1, 96)),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_float64(batch, features, seed):
    rng = np.random.default_rng(seed)
    fan_in, fan_out = features
    x = rng.normal(size=(*batch, fan_in))
    w = rng.normal(size=(fan_out, fan_in)) * 0.5
    out = jax.jit(linear)(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    assert out.shape == (*batch, fan_out)
    np.testing.assert_allclose(out, x @ w.T, **TOL)


@pytest.mark.parametrize("rows", [2, 8, SMALL_ROWS])
def test_small_rows_take_the_weight_left_form_on_cpu(rows):
    x, w = jnp.ones((rows, 16)), jnp.ones((24, 16))
    small = jax.jit(linear).lower(x, w).as_text()
    large = jax.jit(linear).lower(jnp.ones((SMALL_ROWS + 1, 16)), w).as_text()
    # The barrier marks the swapped product; the large-row lowering is the plain dot.
    assert ("optimization_barrier" in small) == (jax.default_backend() == "cpu")
    assert "optimization_barrier" not in large


def test_gradients_and_vmap_agree_with_float64():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 2, 16))  # 8 rows: the small-row form on CPU
    w = rng.normal(size=(24, 16)) * 0.5
    ct = rng.normal(size=(4, 2, 24))  # cotangent, so the gradient is not a plain sum

    def loss(x, w):
        return jnp.sum(linear(x, w) * jnp.asarray(ct, jnp.float32))

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    )
    np.testing.assert_allclose(gx, ct @ w, **TOL)
    np.testing.assert_allclose(gw, np.einsum("bso,bsi->oi", ct, x), rtol=1e-5, atol=1e-4)
    per_row = jax.vmap(linear, in_axes=(0, None))(jnp.asarray(x, jnp.float32), jnp.asarray(w))
    np.testing.assert_allclose(per_row, x @ w.T, **TOL)


def test_computes_in_input_dtype_and_names_bad_shapes():
    out = linear(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((4, 16), jnp.float32))
    assert out.dtype == jnp.bfloat16
    # Under the test suite's jaxtyping hook the annotations catch these first (a TypeError
    # subclass); without it, linear's own ValueError does. Either names the weight's shape.
    with pytest.raises((ValueError, TypeError), match=r"4, ?15"):
        linear(jnp.ones((8, 16)), jnp.ones((4, 15)))
    with pytest.raises((ValueError, TypeError), match=r"2, ?4, ?16"):
        linear(jnp.ones((8, 16)), jnp.ones((2, 4, 16)))
    unchecked = getattr(linear, "__wrapped__", linear)  # the function under the hook's wrapper
    with pytest.raises(ValueError, match=r"input features 16 != weight's 15 .*\(8, 16\)"):
        unchecked(jnp.ones((8, 16)), jnp.ones((4, 15)))


def _rope_and_norm(y, residual):
    """What consumes q/k (RoPE) and o/down (residual add + RMS norm): XLA fuses them with
    whatever produces ``y``."""
    half = y.shape[-1] // 2
    rotated = jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)
    rope = y * jnp.cos(residual) + rotated * jnp.sin(residual)
    h = residual + y
    return rope, h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)


# (1,): one row; (1, 16): the weight on the left (CPU); (3, 30): on the right.
@pytest.mark.parametrize("batch", [(1,), (1, 16), (3, 30)])
def test_a_zero_addend_changes_no_bit_of_what_consumes_the_product(batch):
    rng = np.random.default_rng(len(batch))
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    x, ws, residual, addend = f32(*batch, 40), [f32(24, 40), f32(8, 40)], f32(*batch, 24), None
    # The addend is computed in the same program (scaled, as a LoRA update is), so XLA could
    # fuse it into the consumers if it were added after the product.
    scaled = lambda a: None if a is None else 2.0 * a
    one = jax.jit(lambda x, w, a: _rope_and_norm(linear(x, w, addend=scaled(a)), residual))
    for got, want in zip(one(x, ws[0], jnp.zeros_like(residual)), one(x, ws[0], None), strict=True):
        np.testing.assert_array_equal(got, want)
    addend = f32(*batch, 24)
    reference = _rope_and_norm(x @ ws[0].T + 2.0 * addend, residual)
    for got, want in zip(one(x, ws[0], addend), reference, strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    # The gradient is that of a plain sum, for a zero addend too (a LoRA B starting at 0).
    ct = f32(*batch, 24)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(linear(x, ws[0], addend=a) * ct)))
    np.testing.assert_array_equal(grad(jnp.zeros_like(ct)), ct)


def test_addend_shape_is_checked():
    unchecked = getattr(linear, "__wrapped__", linear)
    with pytest.raises(ValueError, match=r"addend \(8, 5\) != the product's shape \(8, 4\)"):
        unchecked(jnp.ones((8, 16)), jnp.ones((4, 16)), addend=jnp.ones((8, 5)))
