"""edl.train.preference / preference_step: every preference loss and its metrics against TRL
1.16's own methods, sequence log-probs against float64 numpy from full logits, the LoRA-off
reference against a held frozen copy, and DPO / reward-model training through edl.train."""

import dataclasses
import os
import types
from collections import defaultdict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_LLAMA
from jaxtyping import TypeCheckError

import edl
from edl.lora import apply_lora, lora_trainable, unwrap_lora
from edl.train import (
    CheckpointConfig,
    LogConfig,
    RunConfig,
    dpo_loss,
    make_dpo_step,
    make_reward_step,
    train,
)
from edl.train.callbacks import Throughput
from edl.train.core import StepInfo
from edl.train.preference import orpo_loss, sequence_logps, simpo_loss
from edl.train.preference_step import preference_logps, reward_loss

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch = pytest.importorskip("torch")

# ---------------------------------------------------------------- losses vs TRL (torch) ---

# Fixed per-sequence log-probs (summed over completions), with margins of both signs.
_RNG = np.random.default_rng(0)
_B = 6
_PC = -_RNG.uniform(5.0, 40.0, _B)
_PR = -_RNG.uniform(5.0, 40.0, _B)
_RC = _PC + _RNG.normal(0.0, 3.0, _B)
_RR = _PR + _RNG.normal(0.0, 3.0, _B)
_LEN_C = _RNG.integers(1, 12, _B).astype(np.float64)
_LEN_R = _RNG.integers(1, 12, _B).astype(np.float64)
# Loss and metrics in float32 from float32 inputs of magnitude <= ~50: a few ulps of 50.
_TOL = dict(rtol=2e-6, atol=2e-5)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _t64(x):
    return torch.tensor(np.asarray(x, np.float32).astype(np.float64))


def _accelerator():
    return types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)


class _StubModel:
    """Stands in for the policy: returns fixed outputs, whatever it is given."""

    training = True

    def __init__(self, outputs):
        self.outputs = outputs

    def __call__(self, **kwargs):
        return self.outputs


def _trl_dpo(pc, pr, rc, rr, *, beta, loss_type):
    """TRL's ``DPOTrainer._compute_loss`` (trl/trainer/dpo_trainer.py) run on a stand-in
    trainer whose model returns per-token log-probs summing to the given sequence log-probs
    (precomputed reference log-probs, completion lengths ``_LEN_C`` / ``_LEN_R``)."""
    from trl import DPOTrainer

    seq = int(max(_LEN_C.max(), _LEN_R.max())) + 1
    n = len(pc)
    log_probs = torch.zeros(2 * n, seq - 1, dtype=torch.float64)
    log_probs[:, 0] = torch.cat([_t64(pc), _t64(pr)])
    lengths = np.concatenate([_LEN_C, _LEN_R]).astype(int)
    completion = torch.tensor(np.arange(seq)[None] < lengths[:, None], dtype=torch.long)
    outputs = types.SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
        is_top1=torch.zeros_like(log_probs).bool(),
    )
    model = _StubModel(outputs)
    trainer = types.SimpleNamespace(
        model=model,
        accelerator=_accelerator(),
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        use_weighting=False,
        aux_loss_enabled=False,
        label_smoothing=0.0,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2 * n, seq, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, seq, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": _t64(rc),
        "ref_rejected_logps": _t64(rr),
    }
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _trl_cpo(pc, pr, *, beta, loss_type, label_smoothing, simpo_gamma=0.5):
    """TRL's ``CPOTrainer.cpo_loss`` (trl/experimental/cpo/cpo_trainer.py) with ``alpha=0``,
    and the metrics its ``get_batch_loss_metrics`` derives from the returned rewards."""
    from trl.experimental.cpo import CPOTrainer

    trainer = types.SimpleNamespace(
        alpha=0.0,
        loss_type=loss_type,
        beta=beta,
        simpo_gamma=simpo_gamma,
        label_smoothing=label_smoothing,
        accelerator=_accelerator(),
    )
    pc, pr = _t64(pc), _t64(pr)
    losses, chosen, rejected = CPOTrainer.cpo_loss(trainer, pc, pr)
    return float(losses.mean()), _trl_reward_metrics(chosen, rejected, pc, pr)


def _trl_reward_metrics(chosen, rejected, pc, pr):
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/accuracies": float((chosen > rejected).double().mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "logps/chosen": float(pc.mean()),
        "logps/rejected": float(pr.mean()),
    }


def _check(loss, metrics, want_loss, want_metrics):
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want_loss, **_TOL)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, **_TOL)
    for key, want in want_metrics.items():
        assert metrics[key].dtype == jnp.float32, key
        np.testing.assert_allclose(float(metrics[key]), want, **_TOL, err_msg=key)
    assert set(want_metrics) <= set(metrics)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_matches_trl(loss_type, beta):
    loss, metrics = dpo_loss(
        _f32(_PC),
        _f32(_PR),
        _f32(_RC),
        _f32(_RR),
        beta=beta,
        loss_type=loss_type,
        chosen_lengths=_f32(_LEN_C),
        rejected_lengths=jnp.asarray(_LEN_R, jnp.int32),
    )
    want_loss, want = _trl_dpo(_PC, _PR, _RC, _RR, beta=beta, loss_type=loss_type)
    names = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ]
    _check(loss, metrics, want_loss, {k: want[k] for k in names})
    assert 0 < float(metrics["rewards/accuracies"]) < 1  # both signs of margin present


def test_dpo_label_smoothing_matches_trls_conservative_sigmoid():
    """TRL 1.16's DPO ``sigmoid`` has no label smoothing; its conservative form is CPO's
    ``sigmoid`` loss, which on the log-ratios ``policy - ref`` is exactly conservative DPO."""
    beta, ls = 0.3, 0.2
    loss, _ = dpo_loss(_f32(_PC), _f32(_PR), _f32(_RC), _f32(_RR), beta=beta, label_smoothing=ls)
    want_loss, _ = _trl_cpo(
        _PC - _RC, _PR - _RR, beta=beta, loss_type="sigmoid", label_smoothing=ls
    )
    np.testing.assert_allclose(float(loss), want_loss, **_TOL)
    unsmoothed, _ = dpo_loss(_f32(_PC), _f32(_PR), _f32(_RC), _f32(_RR), beta=beta)
    assert abs(float(loss) - float(unsmoothed)) > 1e-3


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_loss_matches_trl(label_smoothing):
    pc, pr = _PC / _LEN_C, _PR / _LEN_R  # SimPO is on length-averaged log-probs
    loss, metrics = simpo_loss(
        _f32(pc), _f32(pr), beta=2.0, gamma=0.7, label_smoothing=label_smoothing
    )
    want_loss, want = _trl_cpo(
        pc, pr, beta=2.0, loss_type="simpo", label_smoothing=label_smoothing, simpo_gamma=0.7
    )
    _check(loss, metrics, want_loss, want)


def test_orpo_loss_matches_trl():
    """TRL's ``ORPOTrainer.odds_ratio_loss`` (trl/experimental/orpo/orpo_trainer.py), loss
    ``nll - losses.mean()`` and metrics as its ``get_batch_loss_metrics``."""
    from trl.experimental.orpo import ORPOTrainer

    # Average log-probs, some near 0 (log1mexp's other branch).
    pc = np.r_[-0.01, -0.3, -1.2, -2.5, -0.7, -4.0]
    pr = np.r_[-0.2, -0.05, -2.0, -1.0, -3.0, -0.9]
    nll, beta = 1.7, 0.25
    loss, metrics = orpo_loss(_f32(pc), _f32(pr), _f32(nll), beta=beta)
    trainer = types.SimpleNamespace(beta=beta, accelerator=_accelerator())
    losses, chosen, rejected, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        trainer, _t64(pc), _t64(pr)
    )
    want = _trl_reward_metrics(chosen, rejected, _t64(pc), _t64(pr))
    want |= {
        "log_odds_ratio": float(ratio),
        "log_odds_chosen": float(log_odds),
        "nll_loss": float(np.float32(nll)),
    }
    _check(loss, metrics, float(np.float32(nll)) - float(losses.mean()), want)
    grads = jax.grad(lambda c: orpo_loss(c, _f32(pr), _f32(nll), beta=beta)[0])(_f32(pc))
    assert np.all(np.isfinite(grads))


def test_reward_loss_matches_trls_formula():
    """Float64 re-derivation of TRL's ``RewardTrainer.compute_loss``
    (trl/trainer/reward_trainer.py, lines 788-795: -logsigmoid(chosen - rejected), plus
    ``center_rewards_coefficient * mean((chosen + rejected)**2)``); its ``accuracy`` metric
    is the fraction with chosen > rejected. (It needs a model forward, so it is not called.)"""
    chosen, rejected = _RNG.normal(size=8), _RNG.normal(size=8)
    c64, r64 = (np.float32(x).astype(np.float64) for x in (chosen, rejected))
    for coef in (None, 0.01):
        loss, metrics = reward_loss(_f32(chosen), _f32(rejected), center_rewards_coefficient=coef)
        want = np.mean(np.logaddexp(0.0, -(c64 - r64))) + (coef or 0.0) * np.mean((c64 + r64) ** 2)
        _check(
            loss,
            metrics,
            want,
            {
                "accuracy": np.mean(c64 > r64),
                "rewards/chosen": c64.mean(),
                "rewards/rejected": r64.mean(),
                "rewards/margins": np.mean(c64 - r64),
            },
        )


def test_losses_reject_bad_inputs():
    x = _f32(_PC)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="'ipo' takes both chosen_lengths and rejected_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo", chosen_lengths=x)
    # Without lengths IPO reads the log-probs as per-token ones: (h - 1 / (2 beta))^2.
    pc, pr, rc, rr = (np.asarray(v, np.float64) for v in (_PC, _PC[::-1], _PC * 0.5, _PC * 0.25))
    h = (pc - rc) - (pr - rr)
    loss, _ = dpo_loss(*(_f32(v) for v in (pc, pr, rc, rr)), beta=0.3, loss_type="ipo")
    np.testing.assert_allclose(float(loss), np.mean((h - 1 / 0.6) ** 2), rtol=1e-5)
    with pytest.raises((ValueError, TypeCheckError), match="policy_chosen_logps"):
        simpo_loss(x.astype(jnp.int32), x.astype(jnp.int32))
    # jaxtyping's check under test, _check_logps's in production
    with pytest.raises((ValueError, TypeCheckError), match="batch"):
        dpo_loss(x, x[:3], x, x)


# ---------------------------------------------------------------- sequence log-probs ---


def _pair_batch(seed, batch=3, seq=9, vocab=TINY_LLAMA["vocab_size"], rejected_seq=None):
    """A preference batch: prompts of 2-4 tokens (labels -100), completions, right padding."""
    rng = np.random.default_rng(seed)
    out = {}
    for side, length in (("chosen", seq), ("rejected", rejected_seq or seq)):
        ids = rng.integers(1, vocab, (batch, length))
        prompt = rng.integers(2, 5, batch)
        used = rng.integers(prompt + 2, length + 1)
        pos = np.arange(length)[None]
        mask = pos < used[:, None]
        labels = np.where(mask & (pos >= prompt[:, None]), ids, -100)
        ids = np.where(mask, ids, 0)
        out |= {
            f"{side}_input_ids": ids,
            f"{side}_labels": labels,
            f"{side}_attention_mask": mask.astype(np.int32),
        }
    return {k: jnp.asarray(v, jnp.int32) for k, v in out.items()}


def _numpy_logps(hidden, head, softcap, ids, labels, mask, average):
    """Float64 reference from full logits (of edl's final hidden states): log_softmax, HF's
    shift, counting a target when its label is not -100, it is attended, and so is its
    context (the position before)."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64).T
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    labels, mask = np.asarray(labels), np.asarray(mask).astype(bool)
    target = labels[:, 1:]
    counted = (target != -100) & mask[:, 1:] & mask[:, :-1]
    picked = np.take_along_axis(logp[:, :-1], np.where(counted, target, 0)[..., None], -1)[..., 0]
    total = np.sum(np.where(counted, picked, 0.0), axis=1)
    return total / np.maximum(counted.sum(1), 1) if average else total


def _lora(tiny_llama):
    """tiny_llama with LoRA adapters whose B is random, so the adapted model differs."""
    model = apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(2))
    params, other = edl.split(model, lora_trainable)
    rng = np.random.default_rng(3)  # numpy: eager jax.random would compile per shape (~8 s)
    noise = lambda x: jnp.asarray(0.2 * rng.normal(size=x.shape), x.dtype)
    return edl.merge(jax.tree.map(lambda x: x + noise(x), params), other)


def _softcapped(model, cap):
    """The same weights under Gemma 2's final soft-cap."""
    config = model.config.replace(final_softcap=cap)
    return dataclasses.replace(model, model=dataclasses.replace(model.model, config=config))


def test_sequence_logps_match_float64_and_lora_off_equals_the_frozen_base(tiny_llama):
    """One compiled program (one compile for the default suite): ``sequence_logps`` summed
    (several chunks, ragged last one) and averaged (one chunk), and soft-capped, against float64
    numpy from full logits (right and left padding, -100 prompts); and the ``reference="lora"``
    path (adapters switched off inside the jitted loss) bit-for-bit equal to the separately
    held frozen base, with chosen and rejected of different lengths."""
    lora, capped = _lora(tiny_llama), _softcapped(tiny_llama, 0.05)
    b = _pair_batch(0)
    ids, labels = b["chosen_input_ids"], b["chosen_labels"].at[0, :2].set(-100)
    mask = b["chosen_attention_mask"].at[0, :2].set(0)  # a left-padded row too
    pairs = _pair_batch(1, rejected_seq=7)

    @jax.jit
    def run(base, capped, lora):
        variants = [
            ("sum", base, False, 5),
            ("mean", base, True, 2048),
            ("capped", capped, False, 5),
        ]
        out = {"hidden": base.model(ids, attention_mask=mask).last_hidden_state}
        for name, model, average, chunk in variants:
            out[name] = sequence_logps(
                model, ids, labels, attention_mask=mask, average=average, chunk_size=chunk
            )
        off = preference_logps(unwrap_lora(lora), pairs, chunk_size=8)
        out["off"] = jax.lax.stop_gradient(off)
        out["base"] = preference_logps(base, pairs, chunk_size=8)
        return out

    out = run(tiny_llama, capped, lora)
    for name, cap, average in (("sum", None, False), ("mean", None, True), ("capped", 0.05, False)):
        want = _numpy_logps(out["hidden"], tiny_llama.head_weight, cap, ids, labels, mask, average)
        assert out[name].dtype == jnp.float32 and out[name].shape == (3,)
        # float32 head matmul and log-softmax vs float64: ~1e-6 relative of ~60.
        np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-5, atol=1e-4)
    assert not np.allclose(out["sum"], out["capped"])

    for key in ("chosen_logps", "rejected_logps", "chosen_lengths", "rejected_lengths"):
        np.testing.assert_array_equal(
            np.asarray(out["off"][key]), np.asarray(out["base"][key]), err_msg=key
        )
    merged = edl.lora.merge_lora(lora)  # the adapters do change the model
    assert not np.allclose(
        merged.model.layers.self_attn.q_proj.weight, tiny_llama.model.layers.self_attn.q_proj.weight
    )
    counted = (np.asarray(pairs["rejected_labels"])[:, 1:] != -100).sum(1)
    np.testing.assert_array_equal(np.asarray(out["base"]["rejected_lengths"]), counted)


def test_dpo_step_errors_name_what_is_wrong(tiny_llama):
    tx = optax.sgd(0.1)
    state = edl.create_state(tiny_llama, tx)
    batch = _pair_batch(2)
    with pytest.raises(ValueError, match=r"no LoRA adapters.*reference='model'"):
        make_dpo_step(tx, donate=False)(state, batch)
    with pytest.raises(ValueError, match=r"batch lacks ref_chosen_logps, ref_rejected_logps"):
        make_dpo_step(tx, reference="batch", donate=False)(state, batch)
    lacking = {k: v for k, v in batch.items() if k != "rejected_labels"}
    with pytest.raises(ValueError, match=r"batch lacks rejected_labels \(it has chosen_"):
        make_dpo_step(tx, loss_type="simpo", donate=False)(state, lacking)
    with pytest.raises(ValueError, match="reference_model is needed exactly when"):
        make_dpo_step(tx, reference="model")
    with pytest.raises((ValueError, TypeCheckError), match="loss_type"):
        make_dpo_step(tx, loss_type="dpo")
    with pytest.raises(ValueError, match="num_labels=1"):
        make_reward_step(tx, donate=False)(state, batch)


# ---------------------------------------------------------------- training ---


def _toy_preferences(n_batches, seed=0, batch=4, seq=8):
    """Prompt: 3 random tokens (labels -100); the chosen completion is token 7 repeated, the
    rejected one random: a preference a tiny model learns in a few steps."""
    rng = np.random.default_rng(seed)
    vocab = TINY_LLAMA["vocab_size"]
    out = []
    for _ in range(n_batches):
        prompt = rng.integers(1, vocab, (batch, 3))
        chosen = np.concatenate([prompt, np.full((batch, seq - 3), 7)], 1)
        rejected = np.concatenate([prompt, rng.integers(1, vocab, (batch, seq - 3))], 1)
        labels = lambda ids: np.where(np.arange(seq)[None] >= 3, ids, -100)
        mask = np.ones((batch, seq), np.int32)
        out.append(
            {
                k: jnp.asarray(v, jnp.int32)
                for k, v in {
                    "chosen_input_ids": chosen,
                    "chosen_labels": labels(chosen),
                    "chosen_attention_mask": mask,
                    "rejected_input_ids": rejected,
                    "rejected_labels": labels(rejected),
                    "rejected_attention_mask": mask,
                }.items()
            }
        )
    return out


class _Preferences:
    """Toy preference batches with a resumable position."""

    def __init__(self, n=12):
        self.count, self._all = 0, _toy_preferences(n)

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return self._all[(self.count - 1) % len(self._all)]

    @property
    def position(self):
        return {"count": self.count}

    def restore(self, position):
        self.count = position["count"]


@pytest.mark.slow  # compiles two DPO train steps (~20-30 s)
def test_lora_and_model_references_give_the_same_step(tiny_llama):
    """One DPO step with the LoRA-off reference equals one with the base model passed as
    ``reference_model`` (an argument of the compiled step, not donated): same metrics."""
    lora = _lora(tiny_llama)
    tx = optax.adam(1e-2)
    batch = _toy_preferences(1)[0]
    _, by_lora = make_dpo_step(tx, donate=False)(
        edl.create_state(lora, tx, trainable=lora_trainable), batch
    )
    step = make_dpo_step(tx, reference="model", reference_model=tiny_llama)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    _, by_model = step.lower(state, batch).compile()(state, batch)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "grad_norm"):
        np.testing.assert_array_equal(np.asarray(by_lora[key]), np.asarray(by_model[key]), key)
    assert float(by_lora["rewards/margins"]) != 0.0
    np.asarray(tiny_llama.model.embed_tokens.weight)  # the reference was not donated


@pytest.mark.slow  # compiles the DPO step on one device and on a mesh of 8 (~40 s)
def test_a_model_reference_runs_on_a_mesh(tiny_llama):
    """``reference="model"`` on a mesh of 8 host devices: the reference's arrays are placed
    by the step's rules (a constant argument, never donated) and the step gives the single
    device's metrics, called and compiled ahead of time by the loop."""
    from edl.sharding import make_mesh, shard_batch
    from edl.train.core import run_loop

    mesh = make_mesh((1, 8, 1, 1))
    lora, tx = _lora(tiny_llama), optax.adam(1e-2)
    batch = _toy_preferences(1, batch=8)[0]
    single = make_dpo_step(tx, reference="model", reference_model=tiny_llama, donate=False)
    _, want = single(edl.create_state(lora, tx, trainable=lora_trainable), batch)
    step = make_dpo_step(tx, reference="model", reference_model=tiny_llama, mesh=mesh)
    _, got = step(edl.create_state(_lora(tiny_llama), tx, trainable=lora_trainable), batch)
    for key in ("loss", "rewards/margins", "grad_norm"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5)
    placed = jax.tree.leaves(step.constants if step._placed is None else step._placed)
    assert all(x.sharding.mesh.shape == mesh.shape for x in placed)
    assert any(not x.sharding.is_fully_replicated for x in placed)  # sharded by the rules
    fresh = edl.create_state(_lora(tiny_llama), tx, trainable=lora_trainable)  # lora's donated
    state, _ = run_loop(fresh, step, iter([shard_batch(batch, mesh)] * 2), steps=2)
    assert int(state.step) == 2
    assert not any(x.is_deleted() for x in jax.tree.leaves(tiny_llama) if eqx.is_array(x))


# The least gain in rewards/margins after 10 steps: rewards are beta * summed log-ratios for
# DPO / IPO (beta 0.1), beta * average log-probs for SimPO (beta 2) and ORPO (beta 0.1); the
# observed gains are ~0.27, 0.27, 1.2 and 0.06.
_MARGIN_GAIN = {"sigmoid": 0.1, "ipo": 0.1, "simpo": 0.5, "orpo": 0.03}


@pytest.mark.slow  # trains tiny_llama + LoRA for 10 steps, once per loss (~6-12 s each)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo", "orpo"])
def test_dpo_training_raises_margins_and_accuracies(tiny_llama, loss_type):
    lora = apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(2))
    tx = optax.adam(1e-2)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    step = make_dpo_step(tx, loss_type=loss_type, reference="lora")
    history = []
    for batch in _toy_preferences(10):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    first, last = history[0], history[-1]
    assert last["rewards/margins"] > first["rewards/margins"] + _MARGIN_GAIN[loss_type]
    assert last["rewards/accuracies"] == 1.0 > first["rewards/accuracies"]
    assert last["loss"] < first["loss"]


@pytest.mark.slow  # three edl.train runs of tiny_llama + LoRA with checkpoints (~15-25 s)
def test_dpo_step_resumes_exactly_in_train(tiny_llama, tmp_path):
    tx = optax.adam(1e-2)

    def run(directory, steps, **kw):  # a fresh LoRA model each run: the step donates params
        lora = apply_lora(tiny_llama, rank=4, alpha=8, key=jax.random.key(2))
        state = edl.create_state(lora, tx, trainable=lora_trainable)
        step = make_dpo_step(tx, reference="model", reference_model=tiny_llama)
        run = RunConfig(
            steps=steps,
            output_dir=directory,
            checkpoint=CheckpointConfig(every=2),
            log=LogConfig(progress=False),
        )
        return train(state, step, _Preferences(), run, **kw)

    whole, _ = run(tmp_path / "whole", 6)
    stop = edl.train.callback(lambda info: edl.train.Stop("pause") if info.step == 3 else None)
    _, first = run(tmp_path / "split", 6, callbacks=[stop])
    assert first["stop_reason"] == "pause"
    resumed, summary = run(tmp_path / "split", 6)
    assert summary["resumed_from"] == 3 and int(resumed.step) == 6
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log = [line for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert '"rewards/margins"' in log[-1]


@pytest.mark.slow  # trains a tiny reward model for 12 steps (~5-9 s)
def test_reward_step_raises_accuracy(tiny_llama):
    from edl.models import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(**TINY_LLAMA, num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification.init(config, key=jax.random.key(4))
    tx = optax.adam(1e-2)
    state = edl.create_state(model, tx)
    step = make_reward_step(tx, center_rewards_coefficient=0.01)
    history = []
    for batch in _toy_preferences(12, seed=1):
        # The random model happens to score the token-7 ending higher, so the preference is
        # flipped here to make it learn (accuracy 0 at first, checked below).
        batch = {
            k.replace("chosen", "x").replace("rejected", "chosen").replace("x", "rejected"): v
            for k, v in batch.items()
        }
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    assert history[0]["accuracy"] == 0.0 and history[-1]["accuracy"] == 1.0
    assert history[-1]["rewards/margins"] > 0.5 > history[0]["rewards/margins"]
    assert history[-1]["loss"] < history[0]["loss"]


def test_token_logps_gradients_match_full_logits():
    """The chunked per-token path's gradients (recomputed chunk logits) against autodiff of
    full float64 logits (weights of both signs, a ragged last chunk, ignored labels)."""
    from edl.ops.losses import causal_lm_token_logps

    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(2, 7, 8)).astype(np.float32)
    head = rng.normal(size=(11, 8)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 7))
    labels[0, :3] = -100
    weights = rng.normal(size=(2, 7)).astype(np.float32)

    def chunked(h, w):
        logps, _ = causal_lm_token_logps(h, w, jnp.asarray(labels, jnp.int32), chunk_size=4)
        return jnp.sum(logps * jnp.asarray(weights))

    with jax.enable_x64():

        def full(h, w):
            logp = jax.nn.log_softmax(h @ w.T, axis=-1)[:, :-1]
            target = jnp.asarray(labels[:, 1:])
            picked = jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], -1)[..., 0]
            return jnp.sum(jnp.where(target != -100, picked, 0.0) * weights[:, :-1].astype(float))

        want = jax.grad(full, argnums=(0, 1))(hidden.astype(np.float64), head.astype(np.float64))
        want = [np.asarray(g) for g in want]
    got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(jnp.asarray(hidden), jnp.asarray(head))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)  # float32 sums


# Two micro-batches in the slow set: a second DPO step compiled (about 10 s).
@pytest.mark.parametrize("accum", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_preference_steps_count_the_tokens_of_both_sequences(tiny_llama, accum):
    """tokens/s counts every token the model runs over (both sequences of each pair), not the
    pairs (issue 46: a DPO run showed 0.49 tokens/s); micro-batches sum."""
    batch = _pair_batch(5, batch=4, seq=9, rejected_seq=7)
    want = int(np.sum(batch["chosen_attention_mask"]) + np.sum(batch["rejected_attention_mask"]))
    lora = _lora(tiny_llama)
    tx = optax.sgd(0.0)
    state = edl.create_state(lora, tx, trainable=lora_trainable)
    _, metrics = make_dpo_step(tx, grad_accum_steps=accum, donate=False)(state, batch)
    assert int(metrics["tokens"]) == want and int(metrics["count"]) == 4
    host = {k: float(v) for k, v in metrics.items()}  # as the loop hands them to callbacks
    info = StepInfo(1, 1, state, host, seconds=2.0, train_seconds=2.0, elapsed=2.0)
    rate = Throughput().metrics(info)
    assert rate["tokens_per_s"] == pytest.approx(want / 2.0)
