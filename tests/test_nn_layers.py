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
