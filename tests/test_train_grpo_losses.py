"""The GRPO loss family (``edl.train.grpo_losses``) against TRL 1.16's own
``GRPOTrainer._compute_loss`` run on a stand-in trainer (every loss type, token and sequence
importance sampling, the KL term, the entropy mask, ``delta``), gradients against TRL's float64
autograd, ``mask_truncated_completions``'s test, gradient accumulation against the single
step, and DAPO's dynamic sampling (group selection, fillers, a resumed run bit-exact)."""

import types
from collections import defaultdict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_grpo import _byte_llama

import edl
from edl.train import ByteTokenizer, CheckpointConfig, GRPOConfig, LogConfig, RunConfig, train
from edl.train.grpo import PromptBatches, _loss_fn, make_grpo_step
from edl.train.grpo_dynamic import fill_groups, varied_groups
from edl.train.grpo_losses import GRPO_LOSSES, grpo_loss, high_entropy_mask
from edl.train.grpo_objective import completion_logprobs, truncated_rows
from edl.train.step import make_train_step

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

_ROWS, _NEW, _MAX_LEN = 6, 5, 7


def _inputs():
    rng = np.random.default_rng(0)
    logp = rng.normal(-2.0, 0.5, (_ROWS, _NEW))
    old = logp + rng.normal(0.0, 0.3, (_ROWS, _NEW))  # ratios well outside 1 +- 0.2 too
    ref = logp + rng.normal(0.0, 0.2, (_ROWS, _NEW))
    adv = rng.normal(0.0, 1.0, _ROWS)
    ent = rng.uniform(0.0, 3.0, (_ROWS, _NEW))
    mask = np.ones((_ROWS, _NEW))
    mask[0, 3:] = 0  # an early EOS
    mask[4, 1:] = 0
    f32 = lambda x: np.asarray(x, np.float32)  # both sides see the same float32 inputs
    return f32(logp), f32(old), f32(ref), f32(adv), f32(ent), f32(mask)


def _trl_loss(logp, old, ref, adv, ent, mask, *, options, grad_accum=1, num_items=None):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on a stand-in trainer whose per-token
    log-probs (a float64 leaf, for its gradient) and entropies are ``logp`` / ``ent``.
    Returns ``(loss, d loss / d logp, metrics)``."""
    t64 = lambda x: torch.tensor(np.asarray(x, np.float64))
    leaf = t64(logp).requires_grad_(True)
    accelerator = types.SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
        pad_across_processes=lambda x, dim, pad_index: x,
        sync_gradients=True,
    )
    o = {
        "loss_type": "dapo",
        "importance_sampling_level": "token",
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "top_entropy_quantile": 1.0,
        **options,
    }
    args = types.SimpleNamespace(
        use_bias_correction_kl=False,
        delta=o.get("delta"),
        sapo_temperature_pos=o.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=o.get("sapo_temperature_neg", 1.05),
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=grad_accum,
    )
    Trainer = trl_grpo.GRPOTrainer
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, t64(ent), None),
        get_high_entropy_mask=lambda *a: Trainer.get_high_entropy_mask(trainer, *a),
        get_gamma_weights=Trainer.get_gamma_weights,
        top_entropy_quantile=o["top_entropy_quantile"],
        off_policy_mask_threshold=None,
        importance_sampling_level=o["importance_sampling_level"],
        beta=o["beta"],
        args=args,
        loss_type=o["loss_type"],
        epsilon_low=o["epsilon"],
        epsilon_high=o["epsilon_high"],
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        accelerator=accelerator,
        max_completion_length=_MAX_LEN,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    mask_t = torch.tensor(mask.astype(np.int64))
    inputs = {
        "prompt_ids": torch.zeros(_ROWS, 2, dtype=torch.long),
        "prompt_mask": torch.ones(_ROWS, 2, dtype=torch.long),
        "completion_ids": torch.zeros(logp.shape, dtype=torch.long),
        "completion_mask": mask_t,
        "advantages": t64(adv),
        "old_per_token_logps": t64(old),
        "ref_per_token_logps": t64(ref),
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }
    loss = Trainer._compute_loss(trainer, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), leaf.grad.numpy(), metrics


def _edl_loss(logp, old, ref, adv, ent, mask, *, options):
    o = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, **options}
    quantile = o.pop("top_entropy_quantile", 1.0)

    def loss(lp):
        return grpo_loss(
            lp,
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            ref_logps=jnp.asarray(ref),
            max_new_tokens=_MAX_LEN,
            entropies=jnp.asarray(ent),
            top_entropy_quantile=quantile,
            **o,
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    return float(value), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


_CASES = [  # the float64 test below runs every loss at sequence level with the KL term
    {"loss_type": t, "importance_sampling_level": level, "beta": beta}
    for t in GRPO_LOSSES
    for level, beta in (("token", 0.04), ("sequence", 0.0))
] + [
    {"loss_type": "cispo", "epsilon_high": 1.1},  # TRL's eps_max: some ratios above it
    {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.6},
    {"loss_type": "grpo", "delta": 1.1},
    {"loss_type": "dapo", "top_entropy_quantile": 0.4, "beta": 0.04},
    {"loss_type": "grpo", "top_entropy_quantile": 0.75, "importance_sampling_level": "sequence"},
]


@pytest.mark.parametrize("options", _CASES, ids=lambda o: "-".join(map(str, o.values())))
def test_grpo_losses_match_trl_compute_loss(options):
    """Loss, gradient (float32 jax vs TRL's float64 autograd) and the clip metric."""
    inputs = _inputs()
    want, want_grad, want_metrics = _trl_loss(*inputs, options=options)
    got, got_grad, got_metrics = _edl_loss(*inputs, options=options)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=2e-4, atol=1e-6)
    if options.get("beta"):
        np.testing.assert_allclose(got_metrics["kl"], want_metrics["kl"], rtol=1e-5)
    clip = want_metrics.get("clip_ratio/region_mean", want_metrics.get("cispo_clip_ratio"))
    if clip is not None:
        np.testing.assert_allclose(got_metrics["clip_ratio"], clip, atol=1e-6)
    np.testing.assert_allclose(got_metrics["entropy"], want_metrics["entropy"], rtol=1e-6)


def test_the_loss_family_computes_in_float64_when_given_float64():
    """A float64 check of one's own: every loss type in float64 agrees with TRL to ~1e-12."""
    inputs = [x.astype(np.float64) for x in _inputs()]
    with jax.enable_x64(True):
        for name in GRPO_LOSSES:
            options = {"loss_type": name, "beta": 0.04, "importance_sampling_level": "sequence"}
            got, got_grad, _ = _edl_loss(*inputs, options=options)
            want, want_grad, _ = _trl_loss(*inputs, options=options)
            # TRL's sapo temperatures are float32 (torch.where of Python floats): 1.05 rounds.
            rtol = 1e-7 if name == "sapo" else 1e-12
            np.testing.assert_allclose(got, want, rtol=rtol, err_msg=name)
            np.testing.assert_allclose(got_grad, want_grad, rtol=rtol, atol=1e-14, err_msg=name)


def test_high_entropy_mask_matches_trl():
    _, _, _, _, ent, mask = _inputs()
    for q in (0.2, 0.5, 0.9):
        trainer = types.SimpleNamespace(
            accelerator=types.SimpleNamespace(
                pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x
            )
        )
        want = trl_grpo.GRPOTrainer.get_high_entropy_mask(
            trainer, torch.tensor(ent), torch.tensor(mask), 1 - q
        ).numpy()
        got = np.asarray(high_entropy_mask(jnp.asarray(ent), jnp.asarray(mask), q))
        np.testing.assert_array_equal(got, want.astype(np.float32))
    empty = high_entropy_mask(jnp.asarray(ent), jnp.zeros_like(jnp.asarray(mask)), 0.5)
    assert not np.any(np.asarray(empty))  # no counted token: none kept, as TRL


def test_truncated_rows_are_those_ending_without_eos_or_pad():
    """TRL: ``ids[-1] not in eos_and_pad`` over each completion's kept tokens."""
    eos, pad = 9, 7
    ids = jnp.asarray([[1, 2, 9, 7], [1, 2, 3, 4], [9, 7, 7, 7], [1, 2, 3, 7]])
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1.0]])
    got = truncated_rows(ids, mask, (eos, pad))
    np.testing.assert_array_equal(np.asarray(got), [False, True, False, False])


def test_config_checks_new_options():
    for field, bad in [
        ("importance_sampling_level", "seq"),
        ("top_entropy_quantile", 0.0),
        ("gradient_accumulation_steps", 0),
        ("loss_type", "ppo"),
        ("max_dynamic_sampling_rounds", -1),
    ]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{field} must be"):
            GRPOConfig(**{field: bad})
    assert GRPOConfig().loss_type == "dapo"  # TRL 1.16's default
    with pytest.raises(ValueError, match="dynamic_sampling needs prompt_source"):
        make_grpo_step(
            optax.sgd(0.1),
            ByteTokenizer(),
            lambda p, c, i: [0.0] * len(c),
            GRPOConfig(dynamic_sampling=True),
            key=jax.random.key(0),
        )


# --- gradient accumulation ------------------------------------------------------------------


class _Bigram(eqx.Module):
    """A model whose logits at a token are its row of ``table``: a cheap compile."""

    table: jax.Array
    model: None = None  # edl.generate.steps.CausalLM's members, never used here

    @property
    def config(self):
        return None

    def lm_logits(self, h):
        return h

    def unstacked(self):
        return self

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        return types.SimpleNamespace(logits=self.table[input_ids])


def _bigram(seed=0):
    return _Bigram(jax.random.normal(jax.random.key(seed), (16, 16)))


def _rollout_batch(rows=8, prompt=3, new=5):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 16, (rows, prompt + new)).astype(np.int32)
    attention = np.ones(ids.shape, bool)
    attention[1, 0] = attention[5, :2] = False  # left padding
    mask = np.ones((rows, new), np.float32)
    mask[2, 2:] = 0
    mask[6, 1:] = 0
    mask[7, :] = 0  # a truncated (masked) completion
    return {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(attention),
        "completion_mask": jnp.asarray(mask),
        "advantages": jnp.asarray(rng.normal(size=rows).astype(np.float32)),
        "old_logps": jnp.asarray(rng.normal(-2.8, 0.3, (rows, new)).astype(np.float32)),
    }


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo", "luspo"])
def test_accumulated_update_equals_the_single_one(loss_type):
    """Two micro-batches of 4 rows then one SGD update == one update on the 8 rows (TRL
    scales each loss type so; bnpo is the exception, below)."""
    config = GRPOConfig(num_generations=4, max_new_tokens=5, loss_type=loss_type, epsilon_high=5.0)
    batch = _rollout_batch()
    params = []
    for accum in (1, 2):
        update = make_train_step(
            _loss_fn(config), optax.sgd(1.0), grad_accum_steps=accum, donate=False
        )
        state, metrics = update(edl.create_state(_bigram(), optax.sgd(1.0)), batch)
        params.append(jax.tree.leaves(state.params))
        assert "accumulation_weight" not in metrics
    for a, b in zip(*params, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # ~6 s
def test_accumulated_bnpo_averages_the_micro_batch_means_as_trl():
    """TRL's bnpo divides each micro-batch's token mean by the accumulation steps: the
    micro-batches weigh the same, whatever their token counts (its docs: "results may
    vary"); the gradient is the mean of the halves' gradients, not the full batch's."""
    config = GRPOConfig(num_generations=4, max_new_tokens=5, loss_type="bnpo")
    batch = _rollout_batch()
    model = _bigram()
    loss = lambda m, b: _loss_fn(config)(m, b)[0]
    halves = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], batch) for i in (0, 1)]
    grads = [jax.grad(loss)(model, h) for h in halves]
    want = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    update = make_train_step(_loss_fn(config), optax.sgd(1.0), grad_accum_steps=2, donate=False)
    state, _ = update(edl.create_state(model, optax.sgd(1.0)), batch)
    before = jax.tree.leaves(edl.create_state(_bigram(), optax.sgd(1.0)).params)
    for p0, p1, g in zip(before, jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(p0 - p1), np.asarray(g), rtol=1e-4, atol=1e-7)


def test_entropy_is_taken_from_the_same_logits():
    model = _bigram()
    batch = _rollout_batch()
    args = (model, batch["input_ids"], batch["attention_mask"], 5, 0.7)
    logps, ent = completion_logprobs(*args, with_entropy=True)
    np.testing.assert_array_equal(np.asarray(logps), np.asarray(completion_logprobs(*args)))
    logits = model(batch["input_ids"]).logits  # no padding effect on the last rows' entropy
    p = jax.nn.softmax(logits[:, -6:-1] / 0.7, axis=-1)
    want = -jnp.sum(p * jnp.log(p), axis=-1)
    np.testing.assert_allclose(np.asarray(ent)[0], np.asarray(want)[0], rtol=1e-4)


# --- dynamic sampling -----------------------------------------------------------------------


def _fake_batch(rewards, prompt_width, tag):
    rows = len(rewards)
    return {
        "input_ids": jnp.full((rows, prompt_width + 2), tag, jnp.int32),
        "attention_mask": jnp.ones((rows, prompt_width + 2), bool),
        "completion_mask": jnp.ones((rows, 2), jnp.float32),
        "advantages": jnp.zeros(rows),
        "rewards": jnp.asarray(rewards, jnp.float32),
    }


def test_varied_groups_and_fill_groups():
    assert list(varied_groups(np.array([1, 1, 0, 1, 0.5, 0.5]), 2)) == [False, True, False]
    first = _fake_batch([1, 1, 0, 1, 2, 2], 1, 10)  # groups: flat, varied, flat
    rounds = iter([["p"], ["q"], ["r"]])
    extra = {"p": _fake_batch([3, 3], 2, 20), "q": _fake_batch([0, 5], 3, 30)}
    calls = []

    def rollout(prompts, key):
        calls.append((prompts[0], key))
        return extra[prompts[0]], {"sample_s": 1.0, "reward_s": 0.5}

    key = jax.random.key(4)
    batch, metrics = fill_groups(
        first, rollout, rounds, num_generations=2, max_rounds=2, key=key, pad_id=0
    )
    # Round 1 (p) is flat; round 2 (q) varies: kept first's varied group, then q's, then a
    # flat filler from the first rollout, masked out.
    assert [c[0] for c in calls] == ["p", "q"]
    assert jax.random.key_data(calls[1][1]).tolist() == (
        jax.random.key_data(jax.random.fold_in(key, 2)).tolist()
    )
    np.testing.assert_array_equal(np.asarray(batch["rewards"]), [0, 1, 0, 5, 1, 1])
    assert batch["input_ids"].shape == (6, 5)  # left-padded to the widest prompt
    np.testing.assert_array_equal(np.asarray(batch["input_ids"][0]), [0, 0, 10, 10, 10])
    np.testing.assert_array_equal(np.asarray(batch["attention_mask"][0]), [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(batch["completion_mask"]).sum(1), [2, 2, 2, 2, 0, 0])
    assert metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/kept_groups": 2.0,
        "dynamic_sampling/filled_groups": 1.0,
        "sample_s": 2.0,
        "reward_s": 1.0,
    }


def _spread(prompts, completions, ids):
    """1 for completions starting with a byte below 128: often the same for a whole group
    of an untrained byte model's 4 samples, so some groups are dropped."""
    return [float(len(i) > 0 and i[0] < 128) for i in ids]


# Three short dynamic-sampling GRPO runs through train(), one a resume: ~150 s on the shared
# 2-core VM under load (sampling up to 3 rollouts a step, checkpoints every step).
@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly(tmp_path):
    config = GRPOConfig(
        num_generations=4,
        max_new_tokens=4,
        dynamic_sampling=True,
        max_dynamic_sampling_rounds=2,
        gradient_accumulation_steps=2,
        mask_truncated_completions=True,
    )
    tx = optax.adam(1e-2)
    prompts = ["ab", "xy", "qq", "hl", "zz", "kk"]  # one width: one compile of the sampler
    step = make_grpo_step(
        tx, ByteTokenizer(), _spread, config, key=jax.random.key(1), prompt_source=iter([])
    )  # one step object for the three runs: one compile of the updates

    def run(steps, out):
        data = PromptBatches(prompts, batch_size=2, seed=1)
        step.prompt_source = data  # the run's own iterator, whose position checkpoints save
        history = []

        def call(state, batch):
            state, metrics = step(state, batch)
            history.append(metrics)
            return state, metrics

        state, summary = train(
            edl.create_state(_byte_llama(), tx),
            call,
            data,
            RunConfig(
                steps=steps,
                output_dir=out,
                checkpoint=CheckpointConfig(every=1),
                log=LogConfig(progress=False),
            ),
        )
        return state, summary, history

    state_a, _, history = run(3, tmp_path / "a")
    assert sum(h["dynamic_sampling/rounds"] for h in history) > 0  # it did draw more prompts
    run(2, tmp_path / "b")
    state_b, summary_b, _ = run(3, tmp_path / "b")  # resumes from step 2
    assert summary_b["resumed_from"] is not None
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
