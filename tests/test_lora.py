"""LoRA: zero-initialised adapters are exact no-ops, only A/B train (QLoRA included) through
the stock train step, merge = adapter forward, generation (of quantized models too) and
checkpoints unchanged, dropout only under a key, and clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import edl
from edl.generate import generate
from edl.io.checkpoint import load_state, save_state
from edl.lora import (
    LoraLinear,
    apply_lora,
    lora_params,
    lora_trainable,
    merge_lora,
    unwrap_lora,
    with_dropout_key,
)
from edl.models import LlamaForCausalLM, configure
from edl.nn import Linear, QuantizedLinear
from edl.ops import causal_lm_loss_from_logits, rms_norm
from edl.quantize import QuantConfig, dequantize, quantize
from edl.train import make_train_step

_forward = jax.jit(lambda m, i: m(i).logits)  # one cache: equal structures compile once


def _logits(model, ids):
    return np.asarray(_forward(model, ids))


def _trained_b(model, scale=0.05):
    """Adapters as if trained: random nonzero B."""

    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(scale * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


@pytest.mark.parametrize(
    ("dtype", "scan"),
    [
        (jnp.float32, True),
        pytest.param(jnp.bfloat16, True, marks=pytest.mark.slow),
        (jnp.float32, False),
    ],
)
def test_zero_initialised_adapters_leave_outputs_bit_identical(tiny_llama, tiny_ids, dtype, scan):
    base = configure(edl.to_dtype(tiny_llama, dtype), scan_layers=scan)
    lora = apply_lora(base, rank=4, alpha=8, key=jax.random.key(2))
    q = lora.model.layers.self_attn.q_proj
    assert isinstance(q, LoraLinear) and q.scaling == 2.0 and q.rank == 4
    assert q.lora_A.weight.shape == (2, 4, 32) and q.lora_B.weight.shape == (2, 32, 4)
    assert q.lora_A.weight.dtype == dtype and not np.any(np.asarray(q.lora_B.weight))
    assert np.all(np.asarray(q.lora_A.weight) != 0)  # A is random, so only B == 0 explains it
    np.testing.assert_array_equal(_logits(lora, tiny_ids), _logits(base, tiny_ids))


# A layer's own output cannot show it (it leaves the program whole): what differed was what
# consumes it. XLA:CPU fuses the consumer (the residual add + RMS norm after o/down_proj and
# the head, RoPE after q/k) with what produced its input, and compiles that fusion
# differently (reduction order, FMA contraction) when one more term, even an all-zero LoRA
# update, comes with it. The 20 rows above happened to compile alike; one row, decode-sized
# and prefill-sized inputs were an ulp off.
def _consumers(layer, x, residual, norm):
    y = layer(x)
    half = y.shape[-1] // 2
    rotated = jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)
    rope = y * jnp.cos(residual) + rotated * jnp.sin(residual)
    return rms_norm(residual + y, norm, 1e-6), rope


@settings(max_examples=10)
@example(batch=(3, 30), features=(40, 24), bias=False, seed=0)  # was off before the fix
@given(  # one row, few rows (one GEMM with the weight on the left on CPU), many rows
    batch=st.sampled_from([(1,), (1, 1), (4, 1), (1, 16), (3, 30), (2, 65)]),
    features=st.tuples(st.sampled_from([16, 40, 48]), st.sampled_from([16, 24, 64])),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_zero_adapter_changes_no_bit_of_what_consumes_the_layer(batch, features, bias, seed):
    fan_in, fan_out = features
    rng = np.random.default_rng(seed)  # numpy: jax.random would compile per shape
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    layer = Linear(0.2 * f32(fan_out, fan_in), f32(fan_out) if bias else None)
    zero = Linear(jnp.zeros((fan_out, 4)), None)
    lora = LoraLinear(layer, Linear(0.2 * f32(4, fan_in), None), zero, scaling=2.0)
    x, residual, norm = f32(*batch, fan_in), f32(*batch, fan_out), 1.0 + 0.1 * f32(fan_out)
    run = jax.jit(_consumers)
    for got, want in zip(run(lora, x, residual, norm), run(layer, x, residual, norm), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# A decode step (few rows) by default; the prefill's zero adapters are checked above too.
@pytest.mark.parametrize("shape", [(2, 1), pytest.param((1, 65), marks=pytest.mark.slow)])
def test_zero_adapters_on_every_layer_change_no_bit_unrolled(tiny_llama, shape):
    """Every projection and the head adapted, layers unrolled (one fusion scope across the
    model): logits and loss as the base model's, at decode and prefill row counts."""
    base = configure(tiny_llama, scan_layers=False)
    lora = apply_lora(base, rank=4, alpha=8, pattern=r"(proj|head)$", key=jax.random.key(2))
    ids = jax.random.randint(jax.random.key(1), shape, 0, base.config.vocab_size)
    np.testing.assert_array_equal(_logits(lora, ids), _logits(base, ids))
    if shape[1] > 1:
        loss = jax.jit(lambda m, i: m.compute_loss(i)[0])
        np.testing.assert_array_equal(np.asarray(loss(lora, ids)), np.asarray(loss(base, ids)))


def test_a_zero_update_still_passes_its_gradient_on():
    """B = 0 must not block B's gradient (the zero update is skipped in the forward only)."""
    layer = Linear.init(16, 8, key=jax.random.key(0))
    lora = LoraLinear.init(layer, rank=4, scaling=2.0, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (6, 16))
    ct = jax.random.normal(jax.random.key(3), (6, 8))
    grad = jax.jit(jax.grad(lambda m: jnp.sum(m(x) * ct)))(lora)
    want = 2.0 * ct.T @ (x @ lora.lora_A.weight.T)  # d/dB of sum(ct * 2 (x A^T) B^T)
    np.testing.assert_allclose(
        np.asarray(grad.lora_B.weight), np.asarray(want), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(grad.lora_A.weight), 0.0)  # B = 0: no A gradient


def test_lora_trainable_splits_out_exactly_the_adapters(tiny_llama):
    lora = apply_lora(
        tiny_llama, rank=4, alpha=8, pattern=r"self_attn\.(q|v)_proj$", key=jax.random.key(2)
    )
    params, other = edl.split(lora, trainable=lora_trainable)
    assert sorted(edl.tree.flatten(params)) == [
        f"model.layers.self_attn.{m}_proj.lora_{ab}.weight" for m in "qv" for ab in "AB"
    ]
    assert not any("lora" in p for p in edl.tree.flatten(other))
    assert jax.tree.structure(lora_params(lora)) == jax.tree.structure(params)
    assert jax.tree.structure(edl.merge(params, other)) == jax.tree.structure(lora)


def _task_batch():
    """A tiny memorisation task: two fixed sequences."""
    ids = jnp.array([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7], [2, 7, 18, 28, 18, 28, 4, 59, 0, 45]])
    return {"input_ids": ids}


def _loss(model, batch):
    return model.compute_loss(batch["input_ids"])


# NF4 (QLoRA) in the slow set: a second whole train step compiled (about 10 s).
@pytest.mark.parametrize("base", ["float32", pytest.param("nf4", marks=pytest.mark.slow)])
def test_training_changes_only_the_adapters(tiny_llama, base):
    frozen = tiny_llama if base == "float32" else quantize(tiny_llama, QuantConfig("nf4"))
    lora = apply_lora(frozen, rank=4, alpha=8, key=jax.random.key(3))
    before = {p: np.asarray(x) for p, x in edl.tree.flatten(lora).items() if hasattr(x, "shape")}
    tx = optax.adam(3e-2)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    moments = [p for p in edl.tree.flatten(state.opt_state) if p.endswith(".weight")]
    assert moments and all(lora_trainable.search(p) for p in moments)
    step = make_train_step(_loss, tx)
    batch = _task_batch()
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses
    after = edl.tree.flatten(edl.state.model(state))
    changed = sorted(p for p, x in before.items() if not np.array_equal(x, np.asarray(after[p])))
    assert changed == sorted(p for p in before if lora_trainable.search(p))
    if base == "nf4":
        assert isinstance(
            edl.state.model(state).model.layers.mlp.up_proj.base_layer, QuantizedLinear
        )


def test_merge_equals_the_adapter_forward_and_unwrap_restores_the_base(tiny_llama, tiny_ids):
    lora = apply_lora(tiny_llama, rank=4, alpha=8, pattern=r"(proj|head)$", key=jax.random.key(4))
    lora = _trained_b(lora)
    assert isinstance(lora.lm_head, LoraLinear)
    out = _logits(lora, tiny_ids)
    assert np.abs(out - _logits(tiny_llama, tiny_ids)).max() > 1e-2  # the adapters matter
    merged = merge_lora(lora)
    assert jax.tree.structure(merged) == jax.tree.structure(tiny_llama)
    np.testing.assert_allclose(_logits(merged, tiny_ids), out, rtol=0, atol=1e-5)
    # The chunked loss reads lm_head.weight: LoraLinear.weight is the merged one.
    loss = jax.jit(lambda m: m.compute_loss(tiny_ids)[0])(lora)
    want = causal_lm_loss_from_logits(jnp.asarray(out), tiny_ids)[0]
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    base = unwrap_lora(lora)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(tiny_llama), strict=True):
        assert a is b


def test_qlora_merge_requantizes_the_merged_weight(tiny_llama):
    qlora = _trained_b(
        apply_lora(
            quantize(tiny_llama, QuantConfig("int8")), rank=4, alpha=8, key=jax.random.key(5)
        )
    )
    merged = merge_lora(qlora)
    layer, before = merged.model.layers.mlp.down_proj, qlora.model.layers.mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.format == "int8"
    want = np.asarray(before.weight)  # dequantized base + scaling * B @ A
    step = np.asarray(layer.scales)[..., None]  # int8 per channel: one scale per row
    assert np.all(np.abs(np.asarray(layer.weight) - want) <= step / 2 * (1 + 1e-5))


@pytest.mark.parametrize("kind", ["lora", pytest.param("nf4", marks=pytest.mark.slow)])
def test_generation_equals_that_of_the_equivalent_dense_model(tiny_llama, kind):
    """LoRA'd vs merged, quantized vs dequantized: the same greedy tokens (the dense weights
    differ from the base's, so generation that ignored the adapters would fail)."""
    if kind == "lora":
        model = _trained_b(apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(6)), 0.3)
        dense = merge_lora(model)
    else:
        model = quantize(tiny_llama, QuantConfig("nf4"))
        dense = dequantize(model)
    prompt = jnp.array([[5, 9, 2, 7], [0, 0, 3, 8]])
    mask = jnp.array([[1, 1, 1, 1], [0, 0, 1, 1]])
    got = generate(model, prompt, attention_mask=mask, max_new_tokens=6)
    want = generate(dense, prompt, attention_mask=mask, max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))


def test_lora_state_checkpoint_round_trip(tiny_llama, tmp_path):
    tx = optax.adamw(1e-3)
    lora = _trained_b(apply_lora(tiny_llama, rank=2, alpha=4, key=jax.random.key(7)))
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    grads = jax.tree.map(lambda p: jnp.sin(p) + 0.1, state.params)  # any non-trivial update
    state = jax.jit(lambda s, g: edl.apply_gradients(s, g, tx))(state, grads)
    save_state(state, tmp_path)
    other = LlamaForCausalLM.init(tiny_llama.config, key=jax.random.key(8))
    fresh = apply_lora(other, rank=2, alpha=4, key=jax.random.key(9))
    loaded, _ = load_state(tmp_path, edl.create_state(fresh, tx, trainable=lora_trainable))
    assert jax.tree.structure(loaded) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_applies_only_with_a_key():
    layer = Linear.init(16, 8, key=jax.random.key(0))
    lora = _trained_b(
        LoraLinear.init(layer, rank=4, scaling=2.0, dropout=0.5, key=jax.random.key(1)), scale=1.0
    )
    x = jax.random.normal(jax.random.key(2), (64, 16))
    no_drop = lora.base_layer(x) + 2.0 * (x @ lora.lora_A.weight.T) @ lora.lora_B.weight.T
    np.testing.assert_allclose(np.asarray(lora(x)), np.asarray(no_drop), rtol=1e-5, atol=1e-5)
    keyed = with_dropout_key({"q_proj": lora}, jax.random.key(3))["q_proj"]
    dropped = np.asarray(keyed(x))
    assert np.abs(dropped - np.asarray(no_drop)).max() > 0.1
    # The mask: inputs kept with probability 1/2 and scaled by 2, as inverted dropout.
    keep = jax.random.bernoulli(keyed.dropout_key, 0.5, x.shape)
    h = jnp.where(keep, 2.0 * x, 0.0)
    want = lora.base_layer(x) + 2.0 * (h @ lora.lora_A.weight.T) @ lora.lora_B.weight.T
    np.testing.assert_allclose(dropped, np.asarray(want), rtol=1e-5, atol=1e-5)
    cleared = with_dropout_key({"q_proj": keyed}, None)["q_proj"]
    assert cleared.dropout_key is None


def test_stacked_dropout_keys_differ_per_layer(tiny_llama):
    lora = apply_lora(tiny_llama, rank=2, alpha=2, dropout=0.1, key=jax.random.key(0))
    keyed = with_dropout_key(lora, jax.random.key(1))
    keys = jax.random.key_data(keyed.model.layers.self_attn.q_proj.dropout_key)
    assert keys.shape[0] == 2 and not np.array_equal(keys[0], keys[1])


def test_errors_name_the_problem(tiny_llama):
    with pytest.raises(ValueError, match=r"matches none of the linear layers.*q_proj"):
        apply_lora(tiny_llama, rank=2, alpha=2, pattern="attention", key=jax.random.key(0))
    lora = apply_lora(tiny_llama, rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"q_proj.*already carry LoRA"):
        apply_lora(lora, rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(tiny_llama)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        apply_lora(tiny_llama, rank=0, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        apply_lora(tiny_llama, rank=2, alpha=2, dropout=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"q_proj.*not plain Linear"):
        quantize(lora, QuantConfig("nf4"))
