"""edl.ops.moe: routing, the experts' MLPs by every dispatch, and the router losses, against
independent references: a float64 numpy loop over tokens and assignments, float64 autodiff of
the dense formulation for gradients, and transformers' own ``load_balancing_loss_func``.

Tolerances: float32 over hidden / intermediate widths <= 16 with O(1) values accumulates
~1e-6 relative error, so 2e-5 (outputs) and 5e-5 (gradients, which sum over tokens) leave
room for summation order without hiding a misrouted token (an O(0.1) change).
"""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from edl.nn import SparseMoE
from edl.ops.moe import (
    RouterStats,
    expert_mlp,
    load_balancing_loss,
    route,
    router_stats,
    router_z_loss,
)

HIDDEN, INTER = 8, 12


def _problem(tokens, experts, top_k, seed, normalize=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
    logits = rng.normal(size=(tokens, experts)).astype(np.float32)
    gate, up = (0.4 * rng.normal(size=(experts, INTER, HIDDEN)).astype(np.float32) for _ in "gu")
    down = 0.4 * rng.normal(size=(experts, HIDDEN, INTER)).astype(np.float32)
    weights, chosen, _ = route(jnp.asarray(logits), top_k, normalize=normalize)
    return tuple(jnp.asarray(a) for a in (x, weights, chosen, gate, up, down))


def _numpy_moe(x, weights, chosen, gate, up, down, capacity=None):
    """float64, one assignment at a time; with ``capacity`` each expert takes its first
    ``capacity`` assignments in (token, k) order and drops the rest."""
    x, weights, gate, up, down = (np.asarray(a, np.float64) for a in (x, weights, gate, up, down))
    chosen = np.asarray(chosen)
    out = np.zeros_like(x)
    taken = np.zeros(gate.shape[0], int)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = chosen[t, j]
            if capacity is not None:
                if taken[e] >= capacity:
                    continue
                taken[e] += 1
            g = gate[e] @ x[t]
            h = g / (1 + np.exp(-g)) * (up[e] @ x[t])
            out[t] += weights[t, j] * (down[e] @ h)
    return out


@pytest.mark.slow  # 15 compiles; test_sparse_moe_layer_equals_its_parts covers the default path
@settings(max_examples=15)
@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 6),
    top_k=st.integers(1, 3),
    impl=st.sampled_from(["blocked", "ragged", "dense"]),
    block_size=st.sampled_from([None, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_expert_mlp_matches_float64_loop(tokens, experts, top_k, impl, block_size, seed):
    top_k = min(top_k, experts)
    x, weights, chosen, gate, up, down = _problem(tokens, experts, top_k, seed)
    out = expert_mlp(x, weights, chosen, gate, up, down, impl=impl, block_size=block_size)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, _numpy_moe(x, weights, chosen, gate, up, down), atol=2e-5)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 8.0])
def test_capacity_drops_overflow_in_token_order(capacity_factor):
    tokens, experts, top_k = 24, 4, 2
    x, weights, chosen, gate, up, down = _problem(tokens, experts, top_k, seed=7)
    chosen = chosen.at[:10].set(jnp.asarray([0, 1], chosen.dtype))  # crowd experts 0 and 1
    capacity = max(1, math.ceil(tokens * top_k / experts * capacity_factor))
    out = expert_mlp(x, weights, chosen, gate, up, down, capacity_factor=capacity_factor)
    expected = _numpy_moe(x, weights, chosen, gate, up, down, capacity=capacity)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    dropless = _numpy_moe(x, weights, chosen, gate, up, down)
    assert (capacity_factor >= 8.0) == np.allclose(expected, dropless)


@pytest.mark.parametrize("block_size", [None, 2])
def test_blocked_backward_matches_float64_autodiff(block_size):
    x, weights, chosen, gate, up, down = _problem(29, 5, 2, seed=3)
    rng = np.random.default_rng(4)
    cotangent = rng.normal(size=x.shape).astype(np.float32)

    def vjp(impl, *args):
        fn = lambda x, w, g, u, d: expert_mlp(
            x, w, chosen, g, u, d, impl=impl, block_size=block_size
        )
        out, pullback = jax.vjp(fn, *args)
        return out, pullback(jnp.asarray(cotangent, out.dtype))

    _, grads = jax.jit(lambda *a: vjp("blocked", *a))(x, weights, gate, up, down)
    with jax.enable_x64(True):
        _, ref = vjp("dense", *(jnp.asarray(a, jnp.float64) for a in (x, weights, gate, up, down)))
        ref = [np.asarray(r) for r in ref]
    for name, g, r in zip(("x", "weights", "gate", "up", "down"), grads, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-5, err_msg=name)


def test_bfloat16_and_float32_master_weights():
    x, weights, chosen, gate, up, down = _problem(16, 4, 2, seed=5)
    out = expert_mlp(jnp.asarray(x, jnp.bfloat16), weights, chosen, gate, up, down)
    assert out.dtype == jnp.bfloat16
    expected = _numpy_moe(x, weights, chosen, gate, up, down)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=0.1, rtol=0.05)


def test_route_renormalises_only_when_asked():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
    w, e, probs = route(logits, 2, normalize=False)
    np.testing.assert_allclose(probs, jax.nn.softmax(logits), rtol=1e-6)
    np.testing.assert_allclose(w, np.sort(np.asarray(probs), axis=1)[:, ::-1][:, :2], rtol=1e-6)
    w_norm, e_norm, _ = route(logits, 2, normalize=True)
    np.testing.assert_array_equal(e, e_norm)
    np.testing.assert_allclose(w_norm, w / w.sum(-1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="top_k=7 for 6 experts"):
        route(logits, 7, normalize=True)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    """Stats summed over layers give transformers' pooled loss (its tensors are per layer,
    concatenated over batch * seq, padding excluded by the attention mask)."""
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    rng = np.random.default_rng(1)
    batch, seq, experts, top_k, layers = 3, 7, 5, 2, 3
    logits = rng.normal(size=(layers, batch * seq, experts)).astype(np.float32)
    mask = np.ones((batch, seq), np.int64)
    mask[0, :3] = 0
    stats = RouterStats.zeros(experts)
    for layer in logits:
        _, chosen, probs = route(jnp.asarray(layer), top_k, normalize=True)
        flat = jnp.asarray(mask.reshape(-1)) if masked else None
        stats = stats + router_stats(jnp.asarray(layer), probs, chosen, flat)
    expected = mixtral.load_balancing_loss_func(
        tuple(torch.tensor(x) for x in logits),
        experts,
        top_k,
        torch.tensor(mask) if masked else None,
    )
    np.testing.assert_allclose(load_balancing_loss(stats), expected.item(), rtol=1e-6)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    weight = np.broadcast_to(mask.reshape(-1) if masked else 1.0, lse.shape)
    z = (lse**2 * weight).sum() / weight.sum()
    np.testing.assert_allclose(router_z_loss(stats), z, rtol=1e-5)


def test_sparse_moe_layer_equals_its_parts():
    moe = SparseMoE.init(HIDDEN, INTER, 4, 2, normalize=False, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, HIDDEN))
    out, stats = moe(x)
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ moe.gate.weight.T
    w, e, _ = route(logits, 2, normalize=False)
    e_ = moe.experts
    ref = expert_mlp(tokens, w, e, e_.gate_proj, e_.up_proj, e_.down_proj, impl="dense")
    np.testing.assert_allclose(out.reshape(-1, HIDDEN), ref, atol=1e-5)
    assert float(stats.tokens) == 10 and float(stats.counts.sum()) == 20
    np.testing.assert_allclose(moe(x, impl="ragged")[0], out, atol=1e-5)
    # A capacity of every assignment (experts * factor >= tokens * top_k / ...) drops none.
    np.testing.assert_allclose(moe(x, capacity_factor=4.0)[0], out, atol=1e-5)
