"""``optimizer="muon"``: optax's Muon on the hidden weight matrices (each layer's matrix of
a stack on its own), AdamW on the rest; vs a float64 Newton-Schulz reference, the
partition, a run that lowers the loss, exact resume in ``train``, and the CLI option."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_LLAMA

import edl
from edl import tree as edl_tree
from edl.nn.layers import Linear, RMSNorm
from edl.nn.stack import stack
from edl.train import OptimizerConfig, RunConfig, make_optimizer, make_train_step, train
from edl.train.optimizers import MATRIX, OPTIMIZERS, muon_dimensions

_NS = (3.4445, -4.775, 2.0315)


class _Stacked(eqx.Module):
    """Two stacked ``(out, in)`` layers with biases and per-layer norms, a tied-free head."""

    layers: Linear
    norms: RMSNorm
    lm_head: Linear

    def __call__(self, x):
        def body(h, layer):
            linear, norm = layer
            return jnp.tanh(linear(norm(h))), None

        h, _ = jax.lax.scan(body, x, (self.layers, self.norms))
        return self.lm_head(h)[..., 0]


def _stacked(dim=6, key=0):
    keys = jax.random.split(jax.random.key(key), 3)
    layers = stack(
        lambda k: Linear.init(dim, dim, use_bias=True, std=0.5, key=k), jax.random.split(keys[0], 2)
    )
    norms = stack(lambda k: RMSNorm.init(dim), jax.random.split(keys[2], 2))
    return _Stacked(layers, norms, Linear.init(dim, 1, std=0.5, key=keys[1]))


def _loss(model, batch):
    err = jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)
    return err, {"loss": err}


def _batch(seed=0, n=16, dim=6):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, dim)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n,)), jnp.float32),
    }


def _muon(**kw):
    return make_optimizer(OptimizerConfig(name="muon", total_steps=100, schedule="constant", **kw))[
        0
    ]


def _labels(params):
    specs = muon_dimensions(params)
    is_leaf = lambda x: x is None or x == MATRIX
    return {
        p: s is not None
        for p, s in edl_tree.flatten(specs, is_leaf=is_leaf).items()
        if p in edl_tree.flatten(params)
    }


def test_muon_takes_the_hidden_matrices_of_a_llama_and_adamw_the_rest(tiny_llama):
    """Stacked norms are 2-D like the matrices: the partition goes by layer and key path."""
    from edl.lora import apply_lora, lora_trainable
    from edl.models import Qwen3MoeConfig, Qwen3MoeForCausalLM

    params, _ = edl.split(tiny_llama)
    labels = _labels(params)
    assert params.model.layers.input_layernorm.weight.ndim == 2  # (layers, dim)
    muon = {p for p, m in labels.items() if m}
    assert muon == {
        f"model.layers.{m}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert not labels["model.embed_tokens.weight"] and not labels["lm_head.weight"]
    assert not labels["model.layers.input_layernorm.weight"] and not labels["model.norm.weight"]

    moe = eqx.filter_eval_shape(  # shapes are all the partition reads
        Qwen3MoeForCausalLM.init,
        Qwen3MoeConfig(
            **{
                **TINY_LLAMA,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
            }
        ),
        key=jax.random.key(1),
    )
    moe_labels = _labels(edl.split(moe)[0])
    assert moe_labels["model.layers.mlp.experts.gate_proj"]  # (layers, experts, out, in)
    assert moe_labels["model.layers.mlp.experts.down_proj"]
    assert moe_labels["model.layers.mlp.gate.weight"]  # the router: a hidden matrix

    lora = eqx.filter_eval_shape(
        lambda: apply_lora(tiny_llama, rank=2, alpha=4, key=jax.random.key(2))
    )
    lora_labels = _labels(edl.split(lora, lora_trainable)[0])
    assert set(lora_labels) == {p for p in lora_labels if "lora_" in p}
    assert all(lora_labels.values())  # (layers, rank, in) and (layers, out, rank) factors


def _newton_schulz64(x, steps=5, eps=1e-8):
    """Muon's quintic Newton-Schulz iteration on one ``(out, in)`` matrix, in float64."""
    x = np.asarray(x, np.float64)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / (np.linalg.norm(x) + eps)
    a, b, c = _NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x if wide else x.T


@pytest.mark.parametrize("consistent_rms", [0.2, 0.0])
def test_muon_update_is_newton_schulz_per_layer_matrix_in_float64(consistent_rms):
    """Two steps on a ``(2, 5, 3)`` stack (tall matrices, transposed inside NS): each layer's
    Nesterov momentum orthogonalised on its own, scaled, decayed, times ``-lr``; the head
    gets AdamW's decay, the norms and biases none. Orthogonalising the flattened stack
    would fail this."""
    model = _stacked()
    model = eqx.tree_at(lambda m: m.layers.weight, model, model.layers.weight[:, :5, :3])
    model = eqx.tree_at(lambda m: m.layers.bias, model, model.layers.bias[:, :5])
    lr, wd, beta = 0.05, 0.1, 0.95
    tx = _muon(
        learning_rate=lr,
        weight_decay=wd,
        muon=edl.train.options.MuonConfig(consistent_rms=consistent_rms),
    )
    params, _ = edl.split(model)
    state = tx.init(params)
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=params.layers.weight.shape) for _ in range(2)]
    w = np.asarray(params.layers.weight, np.float64)
    mu = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g_tree = jax.tree.map(jnp.zeros_like, params)
        g_tree = eqx.tree_at(lambda p: p.layers.weight, g_tree, jnp.asarray(g, jnp.float32))
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int counts and floats
            updates, state = tx.update(g_tree, state, params)
        mu = beta * mu + (1 - beta) * g
        nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
        scale = 0.2 * np.sqrt(5) if consistent_rms else np.sqrt(max(1, 5 / 3))
        want = np.stack([_newton_schulz64(m) for m in nesterov]) * scale + wd * w
        np.testing.assert_allclose(updates.layers.weight, -lr * want, rtol=2e-4, atol=1e-6)
        flat = _newton_schulz64(nesterov.reshape(10, 3)).reshape(2, 5, 3) * scale + wd * w
        assert not np.allclose(updates.layers.weight, -lr * flat, rtol=1e-2)
        params = optax.apply_updates(params, updates)
        w = np.asarray(params.layers.weight, np.float64)
    # AdamW leaves with zero gradients: the head's update is its decay alone; norm scales
    # and biases never decay (transformers' Trainer's rule).
    start = edl.split(model)[0]
    head = np.asarray(start.lm_head.weight, np.float64)
    for _ in grads:
        head = head - lr * wd * head
    np.testing.assert_allclose(params.lm_head.weight, head, rtol=1e-6)
    np.testing.assert_array_equal(params.norms.weight, start.norms.weight)
    np.testing.assert_array_equal(params.layers.bias, start.layers.bias)


def test_muon_is_a_registered_optimizer_and_lowers_the_loss():
    assert "muon" in OPTIMIZERS
    with pytest.raises(ValueError, match=r"OptimizerConfig.name must be one of .*muon.*got 'mu'"):
        OptimizerConfig(name="mu")
    model, tx = _stacked(), _muon(learning_rate=0.02)
    state = edl.create_state(model, tx)
    step = make_train_step(_loss, tx)
    batch = _batch()
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]


class _Batches:
    """Batch ``i`` is ``_batch(seed=i)``; its position resumes with the run."""

    def __init__(self):
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return _batch(seed=self.count)

    @property
    def position(self):
        return {"count": self.count}

    def restore(self, position):
        self.count = position["count"]


def _run(directory, steps, callbacks=()):
    tx = _muon(learning_rate=0.02, weight_decay=0.01)
    batches = _Batches()
    run = RunConfig.from_options(
        {"steps": steps, "output_dir": directory, "save_every": 2, "progress": False}
    )
    return train(
        edl.create_state(_stacked(), tx), make_train_step(_loss, tx), batches, run, callbacks
    )


@pytest.mark.slow  # three edl.train runs with checkpoints (~10 s)
def test_muon_resumes_bit_exactly_in_train(tmp_path):
    """Muon's momentum and the AdamW leaves' moments are checkpointed: a run stopped after
    step 3 and resumed from that checkpoint ends bit-identical to a straight run (every
    array of the state: parameters, both optimizers' moments, counts)."""
    whole, _ = _run(tmp_path / "whole", 6)
    stop = edl.train.callback(lambda info: edl.train.Stop("pause") if info.step == 3 else None)
    _, first = _run(tmp_path / "split", 6, [stop])
    assert first["stop_reason"] == "pause"
    resumed, summary = _run(tmp_path / "split", 6)
    assert summary["resumed_from"] == 3 and int(resumed.step) == 6
    a, b = edl_tree.flatten(whole), edl_tree.flatten(resumed)
    assert a.keys() == b.keys() and any("inner_states.muon" in k for k in a)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_cli_declares_the_muon_options_once():
    from edl._settings import leaves
    from edl.cli.config import ConfigError, TrainConfig

    config = TrainConfig.from_options({"optimizer": "muon", "muon_ns_steps": 3, "steps": 5})
    assert config.muon.ns_steps == 3 and "muon_beta" in leaves(TrainConfig)
    assert "muon_beta" not in TrainConfig.from_options({"steps": 5}).in_effect()
    assert config.in_effect()["muon_ns_steps"] == 3
    with pytest.raises(ConfigError, match="muon_beta"):
        TrainConfig.from_options({"muon_beta": 1.5})
    from edl.cli.run import optimizer

    tx, _ = optimizer(config)
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(edl.split(_stacked())[0])
    # With weight decay, Muon's partition comes first and the AdamW leaves' decay after it.
    partition = state[0] if config.weight_decay else state
    assert "muon" in partition.inner_states
