"""edl.nn.packed_scan: the same values and gradients as ``lax.scan`` (a closure over traced
values, integer and frozen ``xs``, per-iteration outputs, a remat policy in the body), with
no float32 copy of a bfloat16 stack in the compiled CPU program; and the two other pieces
of a bf16 step that saves memory: the ``"dots"`` policy's low-rank exception and the loss's
chunk size by dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.nn.packed_scan import packed_scan
from edl.nn.stack import REMAT_POLICIES, _saves_dot
from edl.ops.losses import causal_lm_loss, default_chunk_size


def _loss(scan, w, frozen, h0, bias, *, remat=False):
    """A scan whose body closes over ``bias`` (traced) and reads an integer ``xs``."""
    scale = jnp.linspace(0.5, 1.5, h0.shape[-1])

    def layer(c, x):
        (w, f), i = x
        h = jnp.tanh(c @ w.astype(c.dtype) + f.astype(c.dtype)[None]) * scale.astype(c.dtype)[None]
        h = h + bias.astype(c.dtype)[None] * i.astype(c.dtype)
        return h, jnp.sum(h.astype(jnp.float32))

    if remat:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES["dots"])
    c, ys = scan(layer, h0, ((w, frozen), jnp.arange(w.shape[0])))
    return jnp.sum(c.astype(jnp.float32) ** 2) + jnp.sum(
        ys * jnp.arange(ys.shape[0], dtype=jnp.float32)
    )


def _inputs(dtype):
    k = jax.random.split(jax.random.key(0), 4)
    w = (0.3 * jax.random.normal(k[0], (5, 16, 16))).astype(dtype)
    frozen = jax.random.normal(k[1], (5, 16)).astype(dtype)
    h0 = jax.random.normal(k[2], (4, 16)).astype(dtype)
    bias = jax.random.normal(k[3], (16,))
    return w, frozen, h0, bias


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_are_lax_scans(dtype, remat):
    w, frozen, h0, bias = _inputs(dtype)

    def grads(scan):
        # ``frozen`` is not differentiated (a LoRA base): the scan gets no cotangent for it.
        fn = lambda w, h0, bias: _loss(scan, w, frozen, h0, bias, remat=remat)
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(w, h0, bias)

    want, got = grads(jax.lax.scan), grads(packed_scan)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_forward_only_and_structure_errors():
    w, frozen, h0, bias = _inputs(jnp.bfloat16)
    np.testing.assert_array_equal(
        _loss(jax.lax.scan, w, frozen, h0, bias), _loss(packed_scan, w, frozen, h0, bias)
    )
    with pytest.raises(ValueError, match="xs has no arrays"):
        packed_scan(lambda c, x: (c, None), h0, None)
    with pytest.raises(ValueError, match="changed the carry's structure"):
        packed_scan(lambda c, x: ((c, c), None), h0, w)


def test_no_float32_copy_of_a_bfloat16_stack_on_cpu():
    """XLA:CPU widened the bfloat16 weight stack a scan slices (a float32 copy of all of it)
    and the residual stack it fills; ``packed_scan`` slices and fills ``uint16`` bits."""
    layers, dim = 8, 256
    w = jnp.zeros((layers, dim, dim), jnp.bfloat16)
    h0 = jnp.zeros((64, dim), jnp.bfloat16)

    def temp_bytes(scan):
        def loss(w, h0):
            c, _ = scan(lambda c, w: (jnp.tanh(c @ w), None), h0, w)
            return jnp.sum(c.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = grad.trace(w, h0).lower(lowering_platforms=("cpu",)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain, packed = temp_bytes(jax.lax.scan), temp_bytes(packed_scan)
    assert plain >= layers * dim * dim * 4  # the widened copy of the stack this avoids
    assert packed <= 0.6 * plain, (packed, plain)  # measured: 2.29 MB against 4.13 MB


def test_the_dots_policy_recomputes_low_rank_products_only():
    x = jax.ShapeDtypeStruct((4, 512, 8), jnp.bfloat16)
    lora_b = jax.ShapeDtypeStruct((576, 8), jnp.bfloat16)
    dense = (jax.ShapeDtypeStruct((4, 512, 576), jnp.bfloat16), lora_b.update(shape=(576, 576)))
    dims = lambda batch: {"dimension_numbers": (((2,), (1,)), (batch, batch))}
    dot = jax.lax.dot_general_p
    assert not _saves_dot(dot, x, lora_b, **dims(()))  # rank 8 -> 576 features: recomputed
    assert _saves_dot(dot, *dense, **dims(()))
    assert _saves_dot(dot, x, lora_b.update(shape=(63, 8)), **dims(()))  # 8 * 8 > 63
    scores = {"dimension_numbers": (((2,), (2,)), ((0,), (0,)))}
    assert _saves_dot(dot, x, x, **scores)  # batched (attention): saved as before
    assert not _saves_dot(jax.lax.exp_p, x)


def test_the_loss_chunk_is_halved_for_16_bit_hidden_states():
    assert default_chunk_size(jnp.float32) == 2048 == default_chunk_size(jnp.float64)
    assert default_chunk_size(jnp.bfloat16) == 1024 == default_chunk_size(jnp.float16)
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (2, 1500, 32)).astype(jnp.bfloat16)
    head = jax.random.normal(k[1], (64, 32)).astype(jnp.bfloat16)
    labels = jax.random.randint(k[2], (2, 1500), 0, 64)
    chunked = lambda size: jax.make_jaxpr(
        lambda h: causal_lm_loss(h, head, labels, chunk_size=size)[0]
    )(hidden)
    # None chooses 1024 tokens here: the program of chunk_size=1024, not that of 2048.
    assert str(chunked(None)) == str(chunked(1024)) != str(chunked(2048))
