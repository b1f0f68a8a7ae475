"""edl.nn leaf layers against float64 numpy and torch's layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import edl
from edl import nn


def test_linear_matches_torch_layout_in_float64():
    lin = nn.Linear.init(5, 3, use_bias=True, key=jax.random.key(0))
    lin = edl.tree.tree_apply({"bias": lambda b: b + 0.5}, lin)
    x = np.random.default_rng(0).normal(size=(2, 4, 5))
    ref = x @ np.asarray(lin.weight, np.float64).T + np.asarray(lin.bias, np.float64)
    np.testing.assert_allclose(lin(jnp.asarray(x, jnp.float32)), ref, rtol=1e-5, atol=1e-6)
    assert lin.weight.shape == (3, 5)
    assert nn.Linear.init(5, 3, key=jax.random.key(0)).bias is None
    assert float(jnp.std(nn.Linear.init(256, 256, key=jax.random.key(1)).weight)) == pytest.approx(
        0.02, rel=0.05
    )
    with pytest.raises(ValueError, match="input features 4 != weight's 5"):
        lin(jnp.ones((2, 4)))


@pytest.mark.parametrize("rows", [1, 6, 80])  # 6: one GEMM on CPU (edl.ops.linear_many)
def test_project_equals_each_layer_and_falls_back_for_wrapped_layers(rows):
    keys = jax.random.split(jax.random.key(0), 4)
    q = nn.Linear.init(12, 8, use_bias=True, key=keys[0])
    q = edl.tree.tree_apply({"bias": lambda b: b + 0.25}, q)
    k, v = (nn.Linear.init(12, 4, key=key) for key in keys[1:3])
    x = jax.random.normal(keys[3], (rows, 12))
    outs = jax.jit(nn.projection.project)(x, q, k, v)
    for out, layer in zip(outs, (q, k, v), strict=True):
        np.testing.assert_allclose(out, layer(x), rtol=1e-5, atol=1e-6)
    # LoRA: the base weight joins the product, the update is added after it.
    lora = nn.LoraLinear.init(k, rank=2, scaling=2.0, key=keys[3])
    np.testing.assert_array_equal(  # a zero adapter changes no bit
        jax.jit(nn.projection.project)(x, q, lora)[1], jax.jit(nn.projection.project)(x, q, k)[1]
    )
    lora = edl.tree.tree_apply({"lora_B.weight": lambda b: b + 0.1}, lora)
    outs = jax.jit(nn.projection.project)(x, q, lora)
    np.testing.assert_allclose(outs[1], lora(x), rtol=1e-5, atol=1e-6)
    assert not np.allclose(outs[1], k(x), atol=1e-3)  # the adapter counted
    # A quantized layer has no dense weight to join: every layer runs on its own.
    quant = nn.QuantizedLinear.from_linear(v, format="int8")
    outs = jax.jit(nn.projection.project)(x, q, quant)
    call = jax.jit(lambda layer, x: layer(x))
    np.testing.assert_array_equal(outs[0], call(q, x))
    np.testing.assert_array_equal(outs[1], call(quant, x))


def test_linear_computes_in_activation_dtype():
    lin = nn.Linear.init(8, 8, use_bias=True, key=jax.random.key(0))
    assert lin(jnp.ones((2, 8), jnp.bfloat16)).dtype == jnp.bfloat16


def test_embedding_lookup_and_tied_head():
    emb = nn.Embedding.init(11, 4, key=jax.random.key(0))
    ids = jnp.array([[0, 3, 10]])
    np.testing.assert_array_equal(emb(ids), np.asarray(emb.weight)[np.asarray(ids)])
    x = jnp.ones((1, 3, 4))
    np.testing.assert_allclose(
        emb.attend(x), np.ones((1, 3, 4)) @ np.asarray(emb.weight).T, rtol=1e-6
    )


def test_rmsnorm_module_and_gemma_offset_start_as_plain_norm():
    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    plain = nn.RMSNorm.init(16, eps=1e-6)
    gemma = nn.RMSNorm.init(16, eps=1e-6, offset=1.0)
    np.testing.assert_array_equal(gemma.weight, np.zeros(16))
    np.testing.assert_allclose(plain(x), gemma(x), rtol=1e-6)
    np.testing.assert_allclose(jnp.mean(plain(x) ** 2, axis=-1), 1.0, rtol=1e-4)
    params, other = edl.split(plain)
    assert set(edl.tree.flatten(params)) == {"weight"}
    assert edl.tree.flatten(other) == {}
