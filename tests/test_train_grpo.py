"""edl.train.grpo: advantages, the k3 KL and the clipped-ratio loss against float64 numpy
references written from TRL 1.16.0 (``trl/trainer/grpo_trainer.py``:
``_generate_and_score_completions`` for the advantages, ``_compute_loss`` for the loss and
the clip ratio; ``trl/trainer/utils.py`` ``nanstd``: Bessel-corrected), EOS masks, per-token
log-probs against an unpadded forward, the LoRA-off reference against a frozen copy, reward
validation, and (slow) end-to-end runs through ``edl.train.train`` sharing the state's
arrays with the sampler, with checkpoint resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.train import (
    ByteTokenizer,
    CheckpointConfig,
    GRPOConfig,
    LogConfig,
    PromptBatches,
    RunConfig,
    make_grpo_step,
    train,
)
from edl.train.grpo import _score
from edl.train.grpo_objective import (
    completion_logprobs,
    completion_mask,
    group_advantages,
    grpo_loss,
    kl_k3,
)
from edl.train.grpo_rewards import score_completions

# --- float64 numpy references (TRL 1.16.0 grpo_trainer.py) ---------------------------------


def _np_advantages(r, g, scale):
    """TRL ``_generate_and_score_completions`` ("sum_then_normalize"): r - group mean, divided
    by (nanstd + 1e-4) of the group ("group") or batch ("batch"); "none": not divided."""
    groups = r.reshape(-1, g)
    adv = (groups - groups.mean(1, keepdims=True)).reshape(-1)
    if scale == "group":
        std = np.repeat(groups.std(1, ddof=1), g)
    elif scale == "batch":
        std = np.full_like(r, r.std(ddof=1))
    else:
        return adv
    return adv / (std + 1e-4)


def _np_loss(logp, old, ref, adv, mask, *, beta, eps, eps_high, loss_type, max_len):
    """TRL ``_compute_loss`` (token-level importance sampling, no delta, no vLLM)."""
    coef_1 = np.exp(logp - old)
    coef_2 = np.clip(coef_1, 1 - eps, 1 + eps_high)
    a = adv[:, None]
    per_token = -np.minimum(coef_1 * a, coef_2 * a)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if beta:
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / max(mask.sum(), 1)
    else:
        loss = (per_token * mask).sum() / (per_token.shape[0] * max_len)
    region = ((coef_1 < 1 - eps) & (a < 0)) | ((coef_1 > 1 + eps_high) & (a > 0))
    masked = lambda x: (x * mask).sum() / mask.sum()
    return loss, masked(kl), masked(region.astype(np.float64))


def _fixed_batch():
    rng = np.random.default_rng(0)
    rows, new = 6, 5
    logp = rng.normal(-2.0, 0.5, (rows, new))
    old = logp + rng.normal(0.0, 0.3, (rows, new))  # ratios well outside 1 +- 0.2 too
    ref = logp + rng.normal(0.0, 0.2, (rows, new))
    adv = rng.normal(0.0, 1.0, rows)
    mask = np.ones((rows, new))
    mask[0, 3:] = 0  # an early EOS
    mask[4, 1:] = 0
    return logp, old, ref, adv, mask


# --- maths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_formula(scale):
    r = np.random.default_rng(1).normal(size=12)
    r[4:8] = 0.5  # a group whose rewards are all equal: advantage 0, no division by 0
    got = group_advantages(jnp.asarray(r, jnp.float32), 4, scale_rewards=scale)
    want = _np_advantages(r, 4, scale)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)  # float32
    assert np.all(np.asarray(got)[4:8] == 0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_stay_finite_for_rewards_near_float32_max(scale):
    """Rewards score_completions accepts (|r| <= float32 max) overflowed the float32 mean and
    std (inf, then NaN advantages and a NaN loss); the power-of-two rescaling keeps them."""
    r = np.array([3e38, 3e38, 2e38, 1e38, -3e38, 3e38, -3e38, 3e38, 1e-3, 2e-3, 0.0, 1.0])
    r = np.concatenate([r, np.full(4, 2e38)])  # a group of equal rewards
    if scale == "none":
        r[4:8] = [3e38, 3e38, 3e38, -1e38]  # centred differences within float32 too
    r32 = r.astype(np.float32)
    got = np.asarray(group_advantages(jnp.asarray(r32), 4, scale_rewards=scale))
    assert np.all(np.isfinite(got))
    want = _np_advantages(r32.astype(np.float64), 4, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[12:], 0.0)  # equal rewards: 0, not 0 / 0


def test_group_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match=r"GRPOConfig.epsilon must be in \[0, 1\), got 1.5"):
        GRPOConfig(epsilon=1.5)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl_formula(loss_type, beta):
    logp, old, ref, adv, mask = _fixed_batch()
    kw = dict(beta=beta, eps=0.2, eps_high=0.28, loss_type=loss_type, max_len=7)
    want_loss, want_kl, want_clip = _np_loss(logp, old, ref, adv, mask, **kw)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    loss, metrics = grpo_loss(
        f32(logp),
        f32(old),
        f32(adv),
        f32(mask),
        ref_logps=f32(ref),
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_new_tokens=7,
    )
    assert 0 < want_clip < 1  # the batch exercises both branches of the clip
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_ratio"]), want_clip, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["kl"]), want_kl if beta else 0.0, rtol=1e-5)
    assert float(metrics["count"]) == mask.sum()


def test_grpo_loss_gradient_is_the_policy_gradient_at_ratio_one():
    """At old == logp (first iteration) d loss / d logp = -A / |o| per unmasked token
    ("grpo"), as in the GRPO paper; masked tokens get none."""
    logp, _, _, adv, mask = _fixed_batch()
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    grad = jax.grad(lambda lp: grpo_loss(lp, jax.lax.stop_gradient(lp), f32(adv), f32(mask))[0])
    want = -adv[:, None] * mask / mask.sum(1, keepdims=True) / mask.shape[0]
    np.testing.assert_allclose(np.asarray(grad(f32(logp))), want, rtol=1e-5, atol=1e-7)


def test_kl_k3():
    rng = np.random.default_rng(2)
    logp, ref = rng.normal(-2, 1, 50), rng.normal(-2, 1, 50)
    got = np.asarray(kl_k3(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32)))
    np.testing.assert_allclose(got, np.exp(ref - logp) - (ref - logp) - 1, rtol=1e-5, atol=1e-6)
    assert np.all(got >= 0) and float(kl_k3(jnp.ones(()), jnp.ones(()))) == 0.0
    # Unbiased: E_{x~p}[k3] = KL(p || q) on a categorical.
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3])
    k3 = np.asarray(
        kl_k3(jnp.log(jnp.asarray(p, jnp.float32)), jnp.log(jnp.asarray(q, jnp.float32)))
    )
    np.testing.assert_allclose((p * k3).sum(), (p * np.log(p / q)).sum(), rtol=1e-5)


def test_completion_mask_stops_after_the_first_eos():
    ids = jnp.asarray([[5, 2, 9, 2, 0], [1, 1, 1, 1, 1], [9, 3, 3, 3, 3], [7, 8, 2, 9, 9]])
    got = np.asarray(completion_mask(ids, (9,)))
    np.testing.assert_array_equal(got, [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    got = np.asarray(completion_mask(ids, (9, 2)))  # several EOS ids: the first of any
    np.testing.assert_array_equal(got[0], [1, 1, 0, 0, 0])


def test_completion_logprobs_of_left_padded_rows_equal_unpadded_forwards(tiny_llama):
    """Positions count real tokens only: a left-padded row gives its unpadded row's
    log-probs (float64 log-softmax of the unpadded logits / temperature)."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(1, 64, n).tolist() for n in (3, 6)]
    new = rng.integers(1, 64, (2, 4))
    width = 6
    ids = np.zeros((2, width + 4), np.int32)
    mask = np.ones((2, width + 4), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) : width], ids[i, width:] = r, new[i]
        mask[i, : width - len(r)] = False
    # The reference: each row unpadded at the front (right-padded: causal, so the padding
    # after it changes nothing), in the same jitted call.
    plain = np.zeros_like(ids)
    for i, r in enumerate(rows):
        plain[i, : len(r) + 4] = r + new[i].tolist()

    @jax.jit
    def both(model, ids, mask, plain):
        return completion_logprobs(model, ids, mask, 4, 0.7), model(plain).logits

    got, plain_logits = both(tiny_llama, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(plain))
    for i, r in enumerate(rows):
        logits = np.asarray(plain_logits[i], np.float64) / 0.7
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        want = logp[len(r) - 1 : len(r) + 3][np.arange(4), new[i]]
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # compiles three forwards of a LoRA model (~6-10 s)
def test_lora_base_reference_equals_a_frozen_copy_exactly(tiny_llama, tiny_ids):
    """``reference="lora_base"`` (unwrap_lora, no copy) gives bit-identical reference
    log-probs to a separately held copy of the base model; the adapters (B made non-zero)
    change the policy's."""
    frozen = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx_array(x) else x, tiny_llama)
    lora = edl.lora.apply_lora(tiny_llama, rank=2, alpha=4, key=jax.random.key(5))
    lora = jax.tree.map(
        lambda x: x + 0.05 if eqx_array(x) and x.ndim == 3 and x.shape[-1] == 2 else x, lora
    )  # B (layers, out, rank) non-zero
    mask = jnp.ones(tiny_ids.shape, bool)

    @jax.jit  # one compile for both
    def both(lora, frozen):
        kw = dict(num_new=4, temperature=1.0, old=True)
        return _score(lora, "lora_base", tiny_ids, mask, **kw), _score(
            lora, frozen, tiny_ids, mask, **kw
        )

    (old_a, ref_a), (old_b, ref_b) = both(lora, frozen)
    np.testing.assert_array_equal(np.asarray(ref_a), np.asarray(ref_b))
    np.testing.assert_array_equal(np.asarray(old_a), np.asarray(old_b))
    assert not np.allclose(np.asarray(old_a), np.asarray(ref_a), atol=1e-4)


def eqx_array(x):
    return isinstance(x, jax.Array)


# --- rewards and config -----------------------------------------------------------------------


def test_score_completions_weights_and_per_function_means():
    a = lambda p, c, ids: [len(x) for x in c]
    a.__name__ = "chars"

    def tokens(p, c, ids):
        return [float(len(i)) for i in ids]

    total, means = score_completions(
        [a, tokens], [1.0, 0.5], ["p", "p"], ["ab", "c"], [[1, 2, 3], [4]]
    )
    np.testing.assert_allclose(total, [2 + 1.5, 1 + 0.5])
    assert means == {"reward/chars": 1.5, "reward/tokens": 2.0}


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], r"'bad' returned shape \(1,\), expected .* \(2,\)"),
        ([1.0, float("nan")], r"'bad' returned non-finite rewards at rows \[1\]"),
        (["x", "y"], "'bad' returned a non-number at row 0: 'x' \\(str\\)"),
        ([[1.0, 2.0], [3.0, 4.0]], r"'bad' returned a non-number at row 0: \[1.0, 2.0\] \(list\)"),
        (np.ones((2, 2)), r"'bad' returned shape \(2, 2\)"),
    ],
)
def test_reward_function_errors_name_the_function(returned, message):
    def bad(prompts, completions, ids):
        return returned

    with pytest.raises(ValueError, match=message):
        score_completions([bad], [1.0], ["p", "p"], ["a", "b"], [[1], [2]])


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([0.5, 1e39], r"'bad' returned non-finite rewards at rows \[1\]: \[1e\+39\] .*float32"),
        ([-1e39, 0.5], r"'bad' returned non-finite rewards at rows \[0\]: \[-1e\+39\]"),
        ([10**400, 0], r"'bad' returned non-finite rewards at rows \[0\]: \[inf\]"),
        (np.array([0.0, 1e39]), r"'bad' returned non-finite rewards at rows \[1\]"),
        ([1.0, "1.0"], r"'bad' returned a non-number at row 1: '1\.0' \(str\)"),
        ([1 + 2j, 1.0], r"'bad' returned a non-number at row 0: \(1\+2j\) \(complex\)"),
        (np.array([1.0, 2.0], np.complex64), r"'bad' returned a non-number at row 0"),
        (np.array(["1", "2"]), r"'bad' returned a non-number at row 0: np.str_\('1'\)"),
        ("12", r"'bad' returned '12' \(str\), not a sequence of rewards"),
        (3.0, r"'bad' returned 3\.0 \(float\), not a sequence of rewards"),
    ],
)
def test_rewards_must_be_real_numbers_finite_in_float32(returned, message):
    """Refused at once, on the host, naming the function, row and value (before: 1e39 passed
    as a finite float64 and became float32 inf, "1.0" was read as 1.0)."""

    def bad(prompts, completions, ids):
        return returned

    with pytest.raises(ValueError, match=message):
        score_completions([bad], [1.0], ["p", "p"], ["a", "b"], [[1], [2]])


def test_a_weighted_sum_beyond_float32_is_refused():
    def a(prompts, completions, ids):
        return [3e38, 1.0]

    def b(prompts, completions, ids):
        return [3e38, 2.0]

    message = r"weighted sum .* at rows \[0\]: \[6e\+38\]; row 0: 'a': 1\.0 \* 3e\+38, 'b': 1\.0 \*"
    with pytest.raises(ValueError, match=message):
        score_completions([a, b], [1.0, 1.0], ["p", "p"], ["x", "y"], [[1], [2]])
    with pytest.raises(ValueError, match=r"weighted sum .* row 0: 'a': 2\.0 \* 3e\+38"):
        score_completions([a], [2.0], ["p", "p"], ["x", "y"], [[1], [2]])
    total, _ = score_completions([a, b], [1.0, -1.0], ["p", "p"], ["x", "y"], [[1], [2]])
    np.testing.assert_array_equal(total, np.float32([0.0, -1.0]))  # the terms cancel


def test_none_means_the_function_does_not_apply_as_in_trl():
    """TRL: None is "no reward from this function"; the weighted sum skips it (nansum) and a
    function's mean counts the rows it applies to. bool counts as 0 / 1 (as TRL reads it)."""

    def math_check(prompts, completions, ids):
        return [
            c == "4" if p == "math" else None for p, c in zip(prompts, completions, strict=True)
        ]

    def code_check(prompts, completions, ids):
        return [None if p == "math" else 0.25 for p in prompts]

    def never(prompts, completions, ids):
        return [None] * len(prompts)

    prompts, completions = ["math", "math", "code"], ["4", "5", "x = 1"]
    fns, ids = [math_check, code_check, never], [[1], [2], [3]]
    total, means = score_completions(fns, [2.0, 1.0, 1.0], prompts, completions, ids)
    np.testing.assert_array_equal(total, np.float32([2.0, 0.0, 0.25]))
    assert means == {"reward/math_check": 0.5, "reward/code_check": 0.25}  # no 'never': no rows
    message = r"no reward function applies to rows \[2\] \(each returned None: 'math_check': None"
    with pytest.raises(ValueError, match=message):
        score_completions([math_check, never], [1.0, 1.0], prompts, completions, ids)


def test_config_and_builder_validation():
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_generations must be >= 2, got 1"):
        GRPOConfig(num_generations=1)
    tx, tok = optax.sgd(0.1), ByteTokenizer()
    with pytest.raises(ValueError, match="reward_weights: need 2 finite weights"):
        make_grpo_step(
            tx, tok, [len, len], GRPOConfig(reward_weights=(1.0,)), key=jax.random.key(0)
        )


# --- end to end (slow) --------------------------------------------------------------------------


def _byte_llama(seed=0):
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(seed))


def _low_bytes(prompts, completions, ids):
    """Share of a completion's tokens below byte 128: varies between samples of an untrained
    byte model (``_count_a`` is mostly 0 for all of them, a group with no learning signal)."""
    return [float(np.mean(np.asarray(i) < 128)) if len(i) else 0.0 for i in ids]


def _count_a(prompts, completions, ids):
    return [c.count("a") / 6 for c in completions]


def _prompts():
    while True:
        yield ["ab", "xyz"]


class _SharedCheck:
    """Wraps ``step.rollout``: records whether the model it samples from holds the state's
    own arrays (the same objects), and the bytes then live that were not live before the run
    (``baseline``: other tests' arrays in this process, such as session fixtures)."""

    def __init__(self, step):
        self.rollout, self.shared, self.live, self.state_leaves = step.rollout, [], [], []
        self.baseline: set[int] = set()
        step.rollout = self

    def __call__(self, model, prompts, key):
        ids = {id(leaf) for leaf in self.state_leaves}
        self.shared.append(all(id(leaf) in ids for leaf in jax.tree.leaves(model)))
        self.live.append(sum(x.nbytes for x in jax.live_arrays() if id(x) not in self.baseline))
        return self.rollout(model, prompts, key)


@pytest.mark.slow  # three short GRPO runs through train(), checkpoints and a resume (~60 s)
def test_grpo_end_to_end_shares_params_and_resumes_exactly(tmp_path):
    config = GRPOConfig(num_generations=4, max_new_tokens=6, num_iterations=2)
    tx = optax.adam(1e-2)

    # One step object for the three runs: one compile of the updates.
    step = make_grpo_step(tx, ByteTokenizer(), _count_a, config, key=jax.random.key(1))
    shared = _SharedCheck(step)

    def call(state, prompts):  # records the state's leaves before each step
        shared.state_leaves = jax.tree.leaves(state)
        return step(state, prompts)

    def run(steps, out):
        shared.shared, shared.live = [], []
        shared.baseline = {id(x) for x in jax.live_arrays()}
        state = edl.create_state(_byte_llama(), tx)
        state, summary = train(
            state,
            call,
            _prompts(),
            RunConfig(
                steps=steps,
                output_dir=out,
                checkpoint=CheckpointConfig(every=1),
                log=LogConfig(progress=False),
            ),
        )
        return state, summary, shared

    state_a, summary_a, shared = run(3, tmp_path / "a")
    assert shared.shared == [True] * 3  # the sampler got the state's own arrays
    state_bytes = edl.nbytes(state_a)
    assert max(shared.live) < state_bytes + edl.nbytes(state_a.params)  # no second copy
    assert int(state_a.step) == 3 and summary_a["end_step"] == 3
    run(2, tmp_path / "b")
    state_b, summary_b, _ = run(3, tmp_path / "b")  # resumes from step 2
    assert summary_b["resumed_from"] is not None
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a LoRA GRPO run with beta > 0 (~18 s)
def test_grpo_lora_with_kl_to_the_base_trains_only_the_adapters():
    model = edl.lora.apply_lora(_byte_llama(), rank=2, alpha=4, key=jax.random.key(2))
    tx = optax.adam(3e-2)
    state = edl.create_state(model, tx, trainable=edl.lora.lora_trainable)
    base = [np.asarray(x) for x in jax.tree.leaves(state.other)]
    config = GRPOConfig(
        num_generations=4, max_new_tokens=6, num_iterations=2, beta=0.1, loss_type="bnpo"
    )
    step = make_grpo_step(
        tx, ByteTokenizer(), [_low_bytes, _low_bytes], config, key=jax.random.key(3)
    )
    kls = []
    for _ in range(3):
        state, metrics = step(state, ["ab", "xyz"])
        assert np.isfinite(metrics["loss"]) and metrics["nonfinite"] == 0
        assert metrics["sample_s"] > 0 and metrics["train_s"] > 0
        assert metrics["reward/_low_bytes"] == pytest.approx(metrics["reward_mean"] / 2, rel=1e-5)
        assert metrics["reward_std"] > 0  # a learning signal in every step
        # tokens/s counts the batch's tokens per update (2 updates); sampled ones apart.
        assert 0 < metrics["sampled_tokens"] <= 2 * 4 * 6
        assert metrics["tokens"] >= 2 * (metrics["sampled_tokens"] + 2 * 4 * len("ab"))
        kls.append(metrics["kl"])
    # B starts at zero (policy == base), then the rewards move the policy away from the base.
    assert min(kls) >= 0 and kls[-1] > 0
    for a, b in zip(base, jax.tree.leaves(state.other), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # the frozen base is untouched


def test_grpo_step_rejects_bad_prompts(tiny_llama):
    step = make_grpo_step(
        optax.sgd(0.1), ByteTokenizer(), _count_a, GRPOConfig(), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match="prompts must be a non-empty list of prompts"):
        step.rollout(tiny_llama, "abc", jax.random.key(0))


def test_reward_functions_receive_the_records_other_fields():
    def exact(prompts, completions, completion_ids, answer):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    total, means = score_completions(
        [exact], [1.0], ["2+2=", "2+2="], ["4", "5"], [[1], [2]], {"answer": ["4", "4"]}
    )
    np.testing.assert_array_equal(total, [1.0, 0.0])
    assert means == {"reward/exact": 0.5}


def test_prompt_batches_are_seeded_split_and_resume_exactly():
    prompts = [{"prompt": f"q{i}", "answer": str(i)} for i in range(7)]
    whole = PromptBatches(prompts, batch_size=4, seed=3)
    first = [next(whole) for _ in range(5)]  # past the end of epoch 0: it repeats
    assert all(len(b) == 4 for b in first)
    assert sorted(p["answer"] for b in first[:1] for p in b) != ["0", "1", "2", "3"]  # shuffled
    epoch0 = [p["answer"] for b in first for p in b][:7]
    assert sorted(epoch0) == [str(i) for i in range(7)]
    halves = [
        PromptBatches(prompts, batch_size=4, seed=3, process_index=i, process_count=2)
        for i in range(2)
    ]
    for batch in first:
        assert [p for h in halves for p in next(h)] == batch
    resumed = PromptBatches(prompts, batch_size=4, seed=3)
    again = PromptBatches(prompts, batch_size=4, seed=3)
    for _ in range(3):
        next(again)
    resumed.restore(json.loads(json.dumps(again.position)))
    assert [next(resumed) for _ in range(2)] == first[3:5]
    once = PromptBatches(["a", "b", "c"], batch_size=2, shuffle=False, repeat=False)
    assert list(once) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match=r"prompts\[1\]: field 'prompt' must be text or a list"):
        PromptBatches(["ok", {"question": "no prompt"}], batch_size=1)
