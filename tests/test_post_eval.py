"""Post-training on MoE models adds the router losses as transformers / TRL do, and the
held-out evaluation of DPO / KTO / reward training (``edl.train.post_eval``) computes the
train step's own metrics.

Oracles: transformers' ``MixtralForCausalLM`` for the load-balancing loss (TRL's DPO adds
``router_aux_loss_coef * outputs.aux_loss`` of the concatenated chosen / rejected pass when
``output_router_logits`` is set; its KTO the same term); the train step's metrics for the
eval step (same loss, same parameters: exact up to XLA's fusion choices, 1e-6).
"""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest
from test_train_kto import _kto_batches
from test_train_preference import _lora, _pair_batch

import edl
from edl.lora import lora_trainable
from edl.train.kto import kto_logps
from edl.train.post_eval import make_dpo_eval_step, make_kto_eval_step, make_reward_eval_step
from edl.train.preference_step import make_dpo_step, preference_logps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COEF = 0.1  # the Mixtral test config's router_aux_loss_coef (test_models_families)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny random Mixtral (4 experts, top-2, output_router_logits) in both libraries."""
    from test_models_families import _hf_model

    hf_model = _hf_model("mixtral")
    path = tmp_path_factory.mktemp("mixtral")
    hf_model.save_pretrained(path)
    return hf_model, edl.from_pretrained(path)


def _hf_aux_loss(hf_model, ids, mask) -> float:
    with torch.no_grad():
        out = hf_model(
            torch.tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
        )
    return out.aux_loss.item()


def _right_padded(*arrays, pad):
    width = max(a.shape[1] for a in arrays)
    return np.concatenate(
        [
            np.pad(np.asarray(a), ((0, 0), (0, width - a.shape[1])), constant_values=pad)
            for a in arrays
        ]
    )


def test_dpo_adds_the_router_loss_of_the_concatenated_pass_as_trl(mixtral):
    hf_model, model = mixtral
    batch = _pair_batch(0, seq=9, rejected_seq=7, vocab=96)
    ids = _right_padded(batch["chosen_input_ids"], batch["rejected_input_ids"], pad=0)
    mask = _right_padded(batch["chosen_attention_mask"], batch["rejected_attention_mask"], pad=0)
    want = _hf_aux_loss(hf_model, ids, mask)

    logps = preference_logps(model, batch)
    np.testing.assert_allclose(float(logps["aux_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(logps["router_loss"]), COEF * want, rtol=1e-5)

    # Policy == reference: DPO's own loss is log 2 exactly, the rest is the router term.
    eval_step = make_dpo_eval_step(beta=0.1, reference="model", reference_model=model)
    state = edl.create_state(model, optax.sgd(0.0))
    metrics = eval_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), math.log(2) + COEF * want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["aux_loss"]), want, rtol=1e-5)
    assert COEF * want > 1e-2  # the term moves the loss


@pytest.mark.slow  # ~9 s; the DPO case runs by default
def test_kto_adds_the_router_loss_of_its_pass(mixtral):
    hf_model, model = mixtral
    batch = next(_kto_batches(1, vocab=96))
    ids = _right_padded(batch["input_ids"], batch["kl_input_ids"], pad=0)
    mask = _right_padded(batch["attention_mask"], batch["kl_attention_mask"], pad=0)
    want = _hf_aux_loss(hf_model, ids, mask)
    np.testing.assert_allclose(float(kto_logps(model, batch)["aux_loss"]), want, rtol=1e-5)

    # Policy == reference: every reward and the KL estimate are 0, so each example's loss
    # is w * (1 - sigmoid(0)) = 0.5.
    eval_step = make_kto_eval_step(reference="model", reference_model=model)
    metrics = eval_step(edl.create_state(model, optax.sgd(0.0)), batch)
    np.testing.assert_allclose(float(metrics["loss"]), 0.5 + COEF * want, rtol=1e-5)


def test_a_dense_models_preference_logps_carry_no_router_terms(tiny_llama):
    logps = preference_logps(tiny_llama, _pair_batch(1))
    assert not {"router_loss", "aux_loss", "z_loss"} & set(logps)


@pytest.mark.slow  # compiles a DPO train step and its eval step on tiny_llama + LoRA (~15 s)
def test_the_dpo_eval_step_gives_the_train_steps_metrics(tiny_llama):
    model = _lora(tiny_llama)  # random B: the policy differs from its LoRA-off reference
    tx = optax.adamw(1e-3)
    state = edl.create_state(model, tx, trainable=lora_trainable)
    batch = _pair_batch(2)
    _, train_metrics = make_dpo_step(tx, beta=0.2, reference="lora", donate=False)(state, batch)
    eval_metrics = make_dpo_eval_step(beta=0.2, reference="lora")(state, batch)
    for name in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "count"):
        np.testing.assert_allclose(
            float(eval_metrics[name]), float(train_metrics[name]), rtol=1e-6, err_msg=name
        )
    assert abs(float(eval_metrics["rewards/margins"])) > 1e-4


def test_eval_steps_check_their_arguments_like_the_train_steps(tiny_llama):
    with pytest.raises(ValueError, match="make_dpo_eval_step: reference_model is needed"):
        make_dpo_eval_step(reference="model")
    with pytest.raises(ValueError, match="make_kto_eval_step: need beta > 0"):
        make_kto_eval_step(beta=0.0, reference="batch")
    step = make_reward_eval_step()
    state = edl.create_state(tiny_llama, optax.sgd(0.0))
    with pytest.raises(ValueError, match="sequence-classification model with num_labels=1"):
        step(state, _pair_batch(0))
