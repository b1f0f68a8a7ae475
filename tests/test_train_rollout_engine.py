"""GRPO rollouts on the serving engine (``edl.train.rollout_engine``, the ``"engine"`` entry
of ``edl.train.rollout_backends.ROLLOUT_BACKENDS``): greedy rollouts equal ``generate``'s
token for token; the engine runs the caller's own arrays (no copy) and new parameters of the
same shapes reuse its compiled programs; a prompt's samples share its prompt pages; sampled
rollouts have ``generate``'s shapes and masks and repeat under the same key; a GRPO step
with the engine backend trains (finite loss) and repeats exactly from the same state; the
option is checked and refused for multi-turn rollouts; (slow) ``edl train --method grpo
--rollout-backend engine``."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import edl
from edl.serve.step import model_step
from edl.train import ByteTokenizer, GRPOConfig, make_grpo_step
from edl.train import rollout_engine as rollout_engine_module
from edl.train.grpo import _left_pad
from edl.train.grpo_objective import completion_mask
from edl.train.rollout_backends import ROLLOUT_BACKENDS, RolloutBackend
from edl.train.rollout_engine import engine_rollouts, rollout_engine

EOS, PAD = 1, 0


def _sample(backend, model, prompts, g, key, **options):
    rows = [p for p in prompts for _ in range(g)]
    settings = dict(top_k=None, top_p=1.0, eos_id=EOS, pad_id=PAD) | options
    return ROLLOUT_BACKENDS[backend].sample(
        model, prompts, g, key, padded=_left_pad(rows, PAD), **settings
    )


def _fresh_arrays(model):
    """``model`` with every float array a new buffer holding the same values."""
    return jax.tree.map(lambda x: x + 0 if isinstance(x, jax.Array) else x, model)


def test_greedy_engine_rollouts_equal_generate_on_the_callers_own_arrays(tiny_llama):
    prompts, g, key = [[5, 6, 7, 8], [9, 10, 11]], 2, jax.random.key(0)
    options = dict(max_new_tokens=3, temperature=0.0)
    want_tokens, want_new = _sample("generate", tiny_llama, prompts, g, key, **options)
    engine = rollout_engine(tiny_llama, prompts, g, max_new_tokens=3, eos_id=EOS)
    # No copy: the engine's model holds the very arrays it was given, stacked.
    leaves = jax.tree.leaves(engine._model), jax.tree.leaves(tiny_llama)
    for mine, given in zip(*leaves, strict=True):
        assert mine is given
        assert mine.unsafe_buffer_pointer() == given.unsafe_buffer_pointer()
    tokens, num_new = engine_rollouts(
        tiny_llama,
        prompts,
        g,
        key,
        top_k=None,
        top_p=1.0,
        eos_id=EOS,
        pad_id=PAD,
        engine=engine,
        **options,
    )
    assert tokens.shape == want_tokens.shape == (4, 3) and tokens.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_array_equal(num_new, want_new)
    # New parameters (new buffers) of the same shapes: the compiled programs are reused.
    compiled = model_step._cache_size()
    again, _ = _sample("engine", _fresh_arrays(tiny_llama), prompts, g, key, **options)
    assert model_step._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(again), np.asarray(want_tokens))


def test_rollout_backend_option_is_checked_and_refused_for_multi_turn():
    with pytest.raises(ValueError, match=r"rollout_backend must be one of generate, engine"):
        GRPOConfig(rollout_backend="vllm")
    config = GRPOConfig(rollout_backend="engine", max_turns=2)
    with pytest.raises(ValueError, match=r"multi-turn rollouts .* sample with edl.generate"):
        make_grpo_step(
            optax.sgd(0.1),
            ByteTokenizer(),
            [],
            config,
            key=jax.random.key(0),
            environment=lambda: None,
        )


def test_a_registered_backend_is_a_valid_choice():
    entry = RolloutBackend("recorded", ROLLOUT_BACKENDS["generate"].sample, "a test's")
    with ROLLOUT_BACKENDS.registered(entry):
        assert GRPOConfig(rollout_backend="recorded").rollout_backend == "recorded"
    with pytest.raises(ValueError, match="rollout_backend must be one of"):
        GRPOConfig(rollout_backend="recorded")


def test_the_cli_option_reaches_grpo_and_toml_and_is_refused_with_an_environment(tmp_path):
    from edl.cli.config import ConfigError, TrainConfig, read_toml, write_toml

    grpo = {"method": "grpo", "model": "m", "data": "d"}
    config = TrainConfig(**grpo, reward="r:f", rollout_backend="engine")
    write_toml(config, tmp_path / "run.toml")
    assert read_toml(tmp_path / "run.toml")["rollout_backend"] == "engine"
    with pytest.raises(ConfigError, match="rollout_backend must be one of generate, engine"):
        TrainConfig(**grpo, reward="r:f", rollout_backend="vllm")
    with pytest.raises(ConfigError, match="--rollout-backend engine is for single-turn"):
        TrainConfig(**grpo, environment="m:f", rollout_backend="engine")


# --- slow --------------------------------------------------------------------------------


@pytest.mark.slow  # compiles both backends' sampled programs for three prompt lengths (~25 s)
def test_sampled_engine_rollouts_share_prompt_pages_and_have_generates_layout(tiny_llama):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, n).tolist() for n in (5, 37, 40)]
    g, key, options = 3, jax.random.key(4), dict(max_new_tokens=8, temperature=1.0)
    engine = rollout_engine(tiny_llama, prompts, g, max_new_tokens=8, eos_id=EOS)
    matched = []
    match = engine._pool.match
    engine._pool.match = lambda hashes: matched.append(len(match(hashes))) or match(hashes)
    settings = dict(top_k=None, top_p=1.0, eos_id=EOS, pad_id=PAD, **options)
    tokens, num_new = engine_rollouts(tiny_llama, prompts, g, key, engine=engine, **settings)
    # 37 and 40 tokens: two whole pages each, computed by the first sample, shared by the rest.
    assert sorted(matched) == [0, 0, 0, 0, 0, 2, 2, 2, 2]
    want_tokens, want_new = _sample("generate", tiny_llama, prompts, g, key, **options)
    assert tokens.shape == want_tokens.shape and tokens.dtype == want_tokens.dtype
    for new, count in ((tokens, num_new), (want_tokens, want_new)):
        mask = np.asarray(completion_mask(new, (EOS,)))
        np.testing.assert_array_equal(mask.sum(1), count)  # EOS included, then padding
        assert (np.asarray(new)[mask == 0] == PAD).all()
    assert len({tuple(r) for r in np.asarray(tokens).tolist()}) > 1  # samples differ
    again, again_new = _sample("engine", tiny_llama, prompts, g, key, **options)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(tokens))  # same key, same draws
    np.testing.assert_array_equal(again_new, num_new)


def _byte_llama():
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(0))


def _low_bytes(prompts, completions, ids):
    return [float(np.mean(np.asarray(i) < 128)) if len(i) else 0.0 for i in ids]


@pytest.mark.slow  # two GRPO steps with the engine backend, each from the same state (~20-30 s)
def test_a_grpo_step_with_the_engine_backend_trains_and_repeats_exactly(monkeypatch):
    shared, state_leaves = [], set()

    def spy(model, *args, **kwargs):  # the engine's model holds the state's own arrays
        engine = rollout_engine(model, *args, **kwargs)
        shared.append(all(id(x) in state_leaves for x in jax.tree.leaves(engine._model)))
        return engine

    monkeypatch.setattr(rollout_engine_module, "rollout_engine", spy)
    tx = optax.adam(1e-2)
    config = GRPOConfig(num_generations=4, max_new_tokens=6, rollout_backend="engine")
    step = make_grpo_step(tx, ByteTokenizer(), _low_bytes, config, key=jax.random.key(1))
    prompts = ["ab", "a longer prompt of two pages or more, shared by its samples"]
    results = []
    for _ in range(2):  # the same state and key twice: what a resumed run does
        state = edl.create_state(_byte_llama(), tx)
        state_leaves = {id(x) for x in jax.tree.leaves(state)}
        state, metrics = step(state, prompts)
        assert np.isfinite(metrics["loss"]) and metrics["nonfinite"] == 0
        assert metrics["reward_std"] > 0 and metrics["sampled_tokens"] > 0
        results.append((step.last_rollout["completions"], jax.tree.leaves(state.params)))
    assert shared == [True, True]
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a two-step `edl train --method grpo --rollout-backend engine` run (~40-90 s)
def test_grpo_with_the_engine_backend_from_the_command_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from edl.cli import main
    from tests.test_cli_post import REWARDS
    from tests.test_finetune_readme import CONVERSATIONS, _build_model

    _build_model(tmp_path / "model")
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": u}], "answer": "Paris"}) + "\n"
            for c in CONVERSATIONS
            for u, _ in c
        )
    )
    monkeypatch.chdir(tmp_path)
    main(
        [
            "train",
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(prompts),
            "--method",
            "grpo",
            "--reward",
            "my_rewards:says_paris",
            "--lora-rank",
            "8",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--num-generations",
            "4",
            "--max-new-tokens",
            "8",
            "--rollout-backend",
            "engine",
            "--output-dir",
            str(tmp_path / "grpo"),
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["end_step"] == 2 and np.isfinite(summary["final_loss"])
    record = (tmp_path / "grpo/run.md").read_text()
    assert "rollout_backend" in record and "engine" in record
