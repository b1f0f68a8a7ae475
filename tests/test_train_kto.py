"""KTO: ``kto_loss`` vs TRL 1.16's own ``KTOTrainer._compute_loss`` on fixed inputs, its
gradients vs float64 autodiff and the closed form, and ``make_kto_step`` training a LoRA."""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_preference import _accelerator

import edl
from edl.lora import apply_lora, lora_trainable
from edl.train.kto import (
    kl_estimate,
    kto_logps,
    kto_loss,
    kto_reference_logps,
    make_kto_step,
)

torch = pytest.importorskip("torch")

_RNG = np.random.default_rng(7)
_B = 8
_POLICY = -_RNG.uniform(5.0, 40.0, _B)
_REF = _POLICY + _RNG.normal(0.0, 3.0, _B)
_KL_POLICY = -_RNG.uniform(5.0, 40.0, _B)
_LABEL = np.array([True, False, True, True, False, False, True, False])


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _t64(x):
    return torch.tensor(np.asarray(x, np.float32).astype(np.float64))


def _trl_kto(policy, ref, kl_policy, kl_ref, label, *, beta, dw, uw):
    """TRL's ``KTOTrainer._compute_loss`` (trl/trainer/kto_trainer.py) on a stand-in trainer
    whose model returns per-token log-probs summing to ``policy`` and whose KL pass returns
    ``kl_policy``; reference log-probs precomputed (``ref_logps`` / ``ref_KL_logps``)."""
    from trl.trainer.kto_trainer import KTOTrainer

    n, seq = len(policy), 4
    log_probs = torch.zeros(n, seq - 1, dtype=torch.float64)
    log_probs[:, 0] = _t64(policy)
    outputs = types.SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
    )
    model_call = lambda **kw: outputs
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_accelerator(),
        _compute_kl_logps=lambda m, b: _t64(kl_policy),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=dw,
        undesirable_weight=uw,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(n, seq, dtype=torch.long),
        "attention_mask": torch.ones(n, seq, dtype=torch.long),
        "completion_mask": torch.ones(n, seq, dtype=torch.long),
        "label": torch.tensor(label),
        "ref_logps": _t64(ref),
        "ref_KL_logps": _t64(kl_ref),
    }
    model = type("M", (), {"__call__": lambda self, **kw: model_call(**kw), "training": True})()
    loss = KTOTrainer._compute_loss(trainer, model, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    ("beta", "dw", "uw", "kl_shift"),
    [(0.1, 1.0, 1.0, -2.0), (0.5, 1.33, 0.7, -2.0), (0.3, 1.0, 1.0, 3.0)],
)
def test_kto_loss_matches_trl(beta, dw, uw, kl_shift):
    """``kl_shift`` > 0 makes the KL estimate negative: clamped at 0 by both."""
    kl_ref = _KL_POLICY + kl_shift + _RNG.normal(0.0, 0.5, _B)
    kl = kl_estimate(_f32(_KL_POLICY), _f32(kl_ref))
    loss, metrics = kto_loss(
        _f32(_POLICY),
        _f32(_REF),
        jnp.asarray(_LABEL),
        kl,
        beta=beta,
        desirable_weight=dw,
        undesirable_weight=uw,
    )
    want_loss, want = _trl_kto(_POLICY, _REF, _KL_POLICY, kl_ref, _LABEL, beta=beta, dw=dw, uw=uw)
    assert (want["kl"] == 0.0) == (kl_shift > 0)
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-6, atol=2e-6)
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        np.testing.assert_allclose(
            float(metrics[key]), want[key], rtol=2e-6, atol=2e-5, err_msg=key
        )
    np.testing.assert_allclose(float(metrics["logps/rejected"]), want["logps/rejected"], rtol=2e-6)


def test_kto_gradients_match_float64_autodiff_and_the_closed_form():
    """d loss / d h_i = -dw β σ'(β (h_i - kl)) / n (desirable), +uw β σ'(β (kl - h_i)) / n
    (undesirable); none flows into the KL estimate."""
    kl_ref = _KL_POLICY - 1.5
    beta, dw, uw = 0.4, 1.2, 0.8

    def loss(policy, kl_policy):
        kl = kl_estimate(kl_policy, jnp.asarray(kl_ref, policy.dtype))
        ref = jnp.asarray(_REF, policy.dtype)
        return kto_loss(
            policy,
            ref,
            jnp.asarray(_LABEL),
            kl,
            beta=beta,
            desirable_weight=dw,
            undesirable_weight=uw,
        )[0]

    with jax.enable_x64(True):
        g64, gkl = jax.grad(loss, argnums=(0, 1))(jnp.asarray(_POLICY), jnp.asarray(_KL_POLICY))
        assert g64.dtype == jnp.float64 and not np.any(np.asarray(gkl))
    g32 = jax.grad(loss)(_f32(_POLICY), _f32(_KL_POLICY))
    h, kl = _POLICY - _REF, max(0.0, np.mean(_KL_POLICY - kl_ref))
    dsig = lambda x: np.exp(-x) / (1 + np.exp(-x)) ** 2
    want = np.where(_LABEL, -dw * beta * dsig(beta * (h - kl)), uw * beta * dsig(beta * (kl - h)))
    np.testing.assert_allclose(np.asarray(g64), want / _B, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(g32), want / _B, rtol=1e-5, atol=1e-7)


def test_kto_loss_checks_its_inputs():
    x = _f32(_POLICY)
    with pytest.raises(ValueError, match="need beta > 0"):
        kto_loss(x, x, jnp.asarray(_LABEL), _f32(0.0), beta=0.0)
    with pytest.raises((ValueError, TypeError), match="batch"):
        kto_loss(x, x[:3], jnp.asarray(_LABEL), _f32(0.0))


def _kto_batches(n, seed=0, batch=4, seq=10, vocab=64):
    """Toy unpaired data: desirable completions end in token 7, undesirable ones in 9; the
    KL rows are each prompt with the previous example's completion."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ids = rng.integers(10, vocab, (batch, seq)).astype(np.int32)
        label = np.array([True, False] * (batch // 2))
        ids[:, -2:] = np.where(label[:, None], 7, 9)
        labels = np.where(np.arange(seq) >= seq - 4, ids, -100).astype(np.int32)
        kl_ids = ids.copy()
        kl_ids[:, -4:] = np.roll(ids[:, -4:], 1, axis=0)
        kl_labels = np.where(np.arange(seq) >= seq - 4, kl_ids, -100).astype(np.int32)
        ones = np.ones((batch, seq), np.int32)
        yield {
            "input_ids": jnp.asarray(ids),
            "labels": jnp.asarray(labels),
            "attention_mask": jnp.asarray(ones),
            "kl_input_ids": jnp.asarray(kl_ids),
            "kl_labels": jnp.asarray(kl_labels),
            "kl_attention_mask": jnp.asarray(ones),
            "label": jnp.asarray(label),
        }


@pytest.mark.slow  # 13 compiled KTO steps of tiny_llama + LoRA (~18 s)
def test_kto_step_trains_a_lora_against_its_base(tiny_llama):
    """The LoRA-off base as reference: the first step's rewards and KL are 0 (policy ==
    reference, up to rounding), the KL metric is kl_estimate of the two models' KL
    log-probs, and training separates desirable from undesirable rewards."""
    lora = apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(3))
    tx = optax.adam(1e-2)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    step = make_kto_step(tx, beta=0.5, reference="lora")
    history = []
    for batch in _kto_batches(12):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    first, last = history[0], history[-1]
    assert abs(first["kl"]) < 1e-5 and abs(first["rewards/margins"]) < 1e-5  # rounding only
    assert first["count"] == 4
    assert last["rewards/margins"] > 0.5 and last["loss"] < first["loss"]
    batch = next(_kto_batches(1, seed=5))
    trained = edl.merge(state.params, state.other)
    policy, base = kto_logps(trained, batch), kto_logps(tiny_llama, batch)
    _, metrics = make_kto_step(tx, beta=0.5, reference="lora", donate=False)(state, batch)
    want = max(0.0, float(kl_estimate(policy["kl_logps"], base["kl_logps"])))
    np.testing.assert_allclose(float(metrics["kl"]), want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two compiled KTO steps of tiny_llama (~8 s)
def test_kto_references_model_and_batch_give_the_same_step(tiny_llama):
    """A frozen reference model passed to the step, and its log-probs precomputed into the
    batch (TRL's precompute_ref_log_probs), give the same metrics and update."""
    lora = apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(4))
    tx = optax.sgd(0.1)
    batch = next(_kto_batches(1, seed=2))
    frozen = jax.tree.map(lambda x: x * 1.01 if x.dtype == jnp.float32 else x, tiny_llama)
    runs = []
    for reference, b, ref_model in (
        ("model", batch, frozen),
        ("batch", kto_reference_logps(frozen, batch), None),
    ):
        state = edl.create_state(lora, tx, trainable=lora_trainable)
        step = make_kto_step(tx, reference=reference, reference_model=ref_model, donate=False)
        runs.append(step(state, b))
    (s1, m1), (s2, m2) = runs
    assert float(m1["kl"]) > 0 or float(m1["rewards/margins"]) != 0  # a distinct reference
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
        np.testing.assert_allclose(float(m1[key]), float(m2[key]), rtol=1e-5, atol=1e-6)
    for a, b2 in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b2), rtol=1e-5, atol=1e-6)
