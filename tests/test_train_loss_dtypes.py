"""The post-training losses take float32 and float64 log-probs and compute in at least
float32: float64 inputs give float64 losses equal to TRL's float64 ones to ~1e-12 (float32
arithmetic would be ~1e-7 off), and float64 gradients equal float64 autodiff of a NumPy
re-derivation; 16-bit inputs are widened to float32; integers are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError
from test_train_preference import _LEN_C, _LEN_R, _PC, _PR, _RC, _RR, _trl_cpo, _trl_dpo

from edl.train import dpo_loss
from edl.train.grpo_objective import grpo_loss
from edl.train.loss_inputs import loss_dtype
from edl.train.preference import orpo_loss, simpo_loss

_TIGHT = dict(rtol=1e-12, atol=1e-12)


def _exact64(x):
    """``x`` as float64 values that float32 holds exactly (TRL's helpers round through it)."""
    return np.asarray(x, np.float32).astype(np.float64)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _check64(loss, metrics, want_loss, want_metrics):
    assert loss.dtype == jnp.float64
    np.testing.assert_allclose(float(loss), want_loss, **_TIGHT)
    for key, want in want_metrics.items():
        assert metrics[key].dtype == jnp.float64, key
        np.testing.assert_allclose(float(metrics[key]), want, **_TIGHT, err_msg=key)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_in_float64_matches_trl_in_float64(loss_type):
    args = [jnp.asarray(_exact64(v)) for v in (_PC, _PR, _RC, _RR)]
    loss, metrics = dpo_loss(
        *args,
        beta=0.3,
        loss_type=loss_type,
        chosen_lengths=jnp.asarray(_LEN_C, jnp.float32),  # mixed widths: cast, not promoted
        rejected_lengths=jnp.asarray(_LEN_R, jnp.int32),
    )
    want_loss, want = _trl_dpo(_PC, _PR, _RC, _RR, beta=0.3, loss_type=loss_type)
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
    _check64(loss, metrics, want_loss, {k: want[k] for k in names})


def test_simpo_and_orpo_in_float64_match_trl_in_float64():
    pc, pr = _exact64(_PC / _LEN_C), _exact64(_PR / _LEN_R)
    loss, metrics = simpo_loss(jnp.asarray(pc), jnp.asarray(pr), beta=2.0, gamma=0.7)
    want_loss, want = _trl_cpo(
        pc, pr, beta=2.0, loss_type="simpo", label_smoothing=0.0, simpo_gamma=0.7
    )
    _check64(loss, metrics, want_loss, want)

    # TRL's ORPO casts to float32 (``.float()``): the reference here is its formula in
    # NumPy float64.
    pc, pr = _exact64([-0.01, -0.3, -1.2, -2.5]), _exact64([-0.2, -0.05, -2.0, -1.0])
    loss, metrics = orpo_loss(jnp.asarray(pc), jnp.asarray(pr), jnp.asarray(1.7), beta=0.25)
    log1mexp = lambda x: np.log(-np.expm1(x))
    log_odds = (pc - pr) - (log1mexp(pc) - log1mexp(pr))
    ratio = -np.log1p(np.exp(-log_odds))
    want = {"log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
    _check64(loss, metrics, 1.7 - 0.25 * ratio.mean(), want)


def _grpo_reference(logps, old, adv, mask, ref, *, beta, eps, loss_type, max_new):
    """TRL's ``_compute_loss`` for token-level ratios, in NumPy float64."""
    ratio = np.exp(logps - old)
    a = adv[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)
    per_token = per_token + beta * (np.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":
        return np.mean(np.sum(per_token * mask, 1) / np.maximum(np.sum(mask, 1), 1))
    if loss_type == "bnpo":
        return np.sum(per_token * mask) / max(np.sum(mask), 1)
    return np.sum(per_token * mask) / (per_token.shape[0] * max_new)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_grpo_loss_in_float64_matches_a_float64_reference(loss_type):
    rng = np.random.default_rng(3)
    logps = rng.normal(-2.0, 1.0, (4, 5))
    old = logps + rng.normal(0.0, 0.3, (4, 5))
    ref = logps + rng.normal(0.0, 0.5, (4, 5))
    adv = rng.normal(size=4)
    mask = (rng.uniform(size=(4, 5)) < 0.8).astype(np.float32)
    kw = dict(beta=0.04, epsilon=0.2, loss_type=loss_type, max_new_tokens=5)

    def f(lp):
        fixed = (jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
        return grpo_loss(lp, *fixed, ref_logps=jnp.asarray(ref), **kw)

    (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logps))
    assert loss.dtype == jnp.float64 and metrics["kl"].dtype == jnp.float64
    want = _grpo_reference(
        logps, old, adv, mask, ref, beta=0.04, eps=0.2, loss_type=loss_type, max_new=5
    )
    np.testing.assert_allclose(float(loss), want, **_TIGHT)
    # The gradient by central differences of the float64 reference (smooth away from the
    # clip edges: these ratios are none within 1e-4 of them).
    h, numeric = 1e-6, np.zeros_like(logps)
    for i in np.ndindex(logps.shape):
        up, down = logps.copy(), logps.copy()
        up[i] += h
        down[i] -= h
        ref_kw = dict(beta=0.04, eps=0.2, loss_type=loss_type, max_new=5)
        numeric[i] = (
            _grpo_reference(up, old, adv, mask, ref, **ref_kw)
            - _grpo_reference(down, old, adv, mask, ref, **ref_kw)
        ) / (2 * h)
    np.testing.assert_allclose(np.asarray(grads), numeric, rtol=1e-6, atol=1e-9)


def test_dpo_gradients_in_float64_equal_the_closed_form():
    """d loss / d policy_chosen = -beta sigmoid(-beta h) / batch for the sigmoid loss."""
    pc, pr, rc, rr = (jnp.asarray(_exact64(v)) for v in (_PC, _PR, _RC, _RR))
    grads = jax.grad(lambda c: dpo_loss(c, pr, rc, rr, beta=0.3)[0])(pc)
    h = (np.asarray(pc) - np.asarray(rc)) - (np.asarray(pr) - np.asarray(rr))
    want = -0.3 / (1 + np.exp(0.3 * h)) / len(h)
    assert grads.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(grads), want, rtol=1e-12, atol=1e-15)


def test_16_bit_inputs_compute_in_float32_and_integers_are_refused():
    x = jnp.asarray(_PC, jnp.bfloat16)
    loss, metrics = simpo_loss(x, x[::-1])
    assert loss.dtype == jnp.float32 and metrics["rewards/margins"].dtype == jnp.float32
    loss, _ = dpo_loss(x, x, x.astype(jnp.float16), x)
    assert loss.dtype == jnp.float32
    # jaxtyping's check under test, loss_dtype's in production: both name the argument
    with pytest.raises((ValueError, TypeCheckError), match="ref_chosen_logps"):
        dpo_loss(x, x, jnp.asarray(_PC, jnp.int32), x)
    with pytest.raises(ValueError, match=r"orpo_loss: log-probs must be float arrays"):
        loss_dtype("orpo_loss", chosen=x, rejected=jnp.zeros(6, jnp.int32))
