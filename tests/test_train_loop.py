"""edl.train: steps (accumulation, clipping, skipping), the loop's hooks, and exact resume."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.train import (
    Hooks,
    NonFiniteLossError,
    OptimizerConfig,
    make_eval_step,
    make_optimizer,
    make_train_step,
    train,
)


def _regression():
    """An MLP and a loss that reports a per-example ``count`` (token-style weighting)."""
    model = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))

    def loss_fn(model, batch):
        pred = jax.vmap(model)(batch["x"])[:, 0]
        err = jnp.where(batch["w"] > 0, (pred - batch["y"]) ** 2, 0.0)
        count = jnp.sum(batch["w"])
        return jnp.sum(err) / count, {"loss": jnp.sum(err) / count, "count": count}

    return model, loss_fn


def _batches(n, size=8, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield {
            "x": jnp.asarray(rng.normal(size=(size, 3)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(size,)), jnp.float32),
            "w": jnp.asarray(np.r_[1, rng.integers(0, 2, size=size - 1)], jnp.float32),
        }


def test_grad_accumulation_equals_the_full_batch_gradient():
    """Micro-batches hold different numbers of counted examples; weighting by the count makes
    the accumulated update the full-batch one."""
    model, loss_fn = _regression()
    tx = optax.sgd(0.1)
    batch = next(_batches(1))
    full = make_train_step(loss_fn, tx, donate=False)
    accum = make_train_step(loss_fn, tx, grad_accum_steps=4, donate=False)
    s_full, m_full = full(edl.create_state(model, tx), batch)
    s_acc, m_acc = accum(edl.create_state(model, tx), batch)
    np.testing.assert_allclose(m_acc["loss"], m_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_acc["grad_norm"], m_full["grad_norm"], rtol=1e-5)
    assert float(m_acc["count"]) == float(m_full["count"])
    for a, b in zip(jax.tree.leaves(s_acc.params), jax.tree.leaves(s_full.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"batch\['\w'\] has leading size 8, not divisible by"):
        make_train_step(loss_fn, tx, grad_accum_steps=3)(edl.create_state(model, tx), batch)


def test_clipping_learning_rate_and_skipping_nonfinite_steps():
    model, loss_fn = _regression()
    config = OptimizerConfig(name="sgd", learning_rate=0.5, total_steps=10, momentum=0.0,
                             warmup_steps=2, schedule="linear")  # fmt: skip
    tx, schedule = make_optimizer(config)
    state = edl.create_state(model, tx)
    batch = next(_batches(1))
    step = make_train_step(loss_fn, tx, clip_norm=1e-3, schedule=schedule, donate=False)
    clipped, metrics = step(state, batch)
    assert float(metrics["learning_rate"]) == 0.0  # warmup starts at 0
    clipped, metrics = step(clipped, batch)
    np.testing.assert_allclose(metrics["learning_rate"], 0.25)
    moved = edl.train.global_norm(jax.tree.map(jnp.subtract, clipped.params, state.params))
    assert float(moved) <= 0.25 * 1e-3 * 1.0001  # one step of lr 0.25 on a clipped gradient

    bad = {**batch, "y": batch["y"].at[0].set(jnp.nan)}
    skip = make_train_step(loss_fn, tx, skip_nonfinite=True, donate=False)
    after, metrics = skip(state, bad)
    assert int(metrics["skipped"]) == 1 and int(after.step) == int(state.step)
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "lion", "sgd"])
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_every_optimizer_and_schedule_trains(name, schedule):
    model, loss_fn = _regression()
    config = OptimizerConfig(name=name, schedule=schedule, learning_rate=1e-2, warmup_steps=1,
                             total_steps=20)  # fmt: skip
    tx, lr = make_optimizer(config)
    assert float(lr(1)) == pytest.approx(1e-2)
    step = make_train_step(loss_fn, tx)
    state = edl.create_state(model, tx)
    batch = next(_batches(1))
    losses = []
    for _ in range(15):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


def _run(tmp_path, steps=6, **kw):
    model, loss_fn = _regression()
    tx = optax.adam(1e-2)
    kw.setdefault("progress", False)
    return train(edl.create_state(model, tx), make_train_step(loss_fn, tx), _batches(100),
                 steps=steps, output_dir=tmp_path, **kw)  # fmt: skip


def test_loop_writes_metrics_checkpoints_and_summary(tmp_path):
    _, loss_fn = _regression()
    state, summary = _run(tmp_path, steps=6, save_every=2, eval_every=3, stats_every=2,
                          eval_step=make_eval_step(loss_fn), eval_data=list(_batches(2, seed=9)),
                          config={"what": "test"})  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert "eval_loss" in lines[2] and "eval_loss" not in lines[0]
    assert summary["final_eval_step"] == 6
    assert summary["final_eval"] == {k: v for k, v in lines[5].items() if k.startswith("eval_")}
    assert "param_norm" in lines[1] and "param_norm" not in lines[0]
    assert all("grad_norm" in m and "time" in m for m in lines)
    assert int(state.step) == 6 and summary["stop_reason"] == "steps"
    assert summary["compile_seconds"] > 0 and summary["final_loss"] == lines[-1]["loss"]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint-00000002", "checkpoint-00000004", "checkpoint-00000006"]
    run_md = (tmp_path / "run.md").read_text()
    assert "final_loss" in run_md and '"what": "test"' in run_md


def test_hooks_see_and_change_state_and_metrics(tmp_path):
    seen = []

    def start(state, metrics):
        seen.append(("start", metrics["step"], int(state.step)))
        return state, {"marker": 7}

    def end(state, metrics):
        seen.append(("end", metrics["step"], int(state.step)))
        return state, {**metrics, "doubled": 2 * metrics["loss"]}

    _run(tmp_path, steps=2, hooks=Hooks(on_step_start=start, on_step_end=end))
    assert seen == [("start", 0, 0), ("end", 1, 1), ("start", 1, 1), ("end", 2, 2)]
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["marker"] == 7 and line["doubled"] == 2 * line["loss"]


def test_nan_loss_stops_with_a_clear_message_or_is_skipped(tmp_path):
    def poison(state, metrics):  # from step 2 on, the state's weights are NaN
        if metrics["step"] == 1:
            state = edl.state.replace(
                state, params=jax.tree.map(lambda p: p * jnp.nan, state.params)
            )
        return state, metrics

    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2"):
        _run(tmp_path / "stop", steps=4, hooks=Hooks(on_step_start=poison))

    model, loss_fn = _regression()
    tx = optax.sgd(1e-2)

    def nan_batches():
        for i, batch in enumerate(_batches(10)):
            yield {**batch, "y": batch["y"] * jnp.nan} if i == 1 else batch

    step = make_train_step(loss_fn, tx, skip_nonfinite=True)
    state, summary = train(edl.create_state(model, tx), step, nan_batches(), steps=4,
                           nan_policy="skip", progress=False)  # fmt: skip
    assert summary["skipped_steps"] == 1 and int(state.step) == 3  # the skipped step: no update
    model, _ = _regression()  # the first run donated the old model's arrays
    with pytest.raises(NonFiniteLossError, match="skip_nonfinite=True"):
        train(edl.create_state(model, tx), make_train_step(loss_fn, tx), nan_batches(),
              steps=4, nan_policy="skip", progress=False)  # fmt: skip


def test_time_limit_and_sigterm_save_before_returning(tmp_path):
    state, summary = _run(tmp_path / "time", steps=50, time_limit=0.0)
    assert summary["stop_reason"] == "time_limit" and int(state.step) == 1
    assert (tmp_path / "time" / "checkpoints" / "checkpoint-00000001" / "state.json").exists()

    def term(state, metrics):
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return state, metrics

    state, summary = _run(tmp_path / "term", steps=50, hooks=Hooks(on_step_end=term))
    assert summary["stop_reason"] == "sigterm" and int(state.step) == 2
    assert (tmp_path / "term" / "checkpoints" / "checkpoint-00000002" / "state.json").exists()


def _script(*args):
    script = Path(__file__).with_name("train_script.py")
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _losses(directory):
    """Per-step loss from metrics.jsonl; a re-run step (after a resume) supersedes."""
    lines = [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines}


def test_resume_after_kill_9_is_bit_identical(tmp_path):
    """Train 8 steps straight; separately SIGKILL a run at step 5 (last checkpoint: step 3),
    then resume it to step 8: the losses of steps 4..8 are bit-identical, and the data
    iterator, optimizer state and step all continued exactly."""
    straight = _script(tmp_path / "straight", 8)
    assert straight.returncode == 0, straight.stderr
    killed = _script(tmp_path / "resumed", 8, 5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert max(_losses(tmp_path / "resumed")) == 4  # killed inside step 5, before logging it
    resumed = _script(tmp_path / "resumed", 8)
    assert resumed.returncode == 0, resumed.stderr
    expected, actual = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(actual) == list(range(1, 9))
    assert [actual[s] for s in range(4, 9)] == [expected[s] for s in range(4, 9)]
    assert len(set(expected.values())) == 8  # the losses do change step to step


def test_cli_train_with_toml_and_flags(tmp_path, capsys):
    from edl.cli import main

    config = tmp_path / "run.toml"
    config.write_text(
        f'output_dir = "{tmp_path / "run"}"\nsteps = 3\nhidden_size = 32\nintermediate_size = 64\n'
        "num_layers = 1\ncorpus_bytes = 200000\neval_every = 2\neval_batches = 1\n"
        "seq_len = 32\nbatch_size = 2\nsample_tokens = 8\n"
    )
    main(["train", "--config", str(config), "--steps", "4", "--save-every", "2"])
    out = capsys.readouterr().out
    summary = json.loads(out.splitlines()[0])
    assert summary["end_step"] == 4 and summary["final_bits_per_byte"] > 0
    assert summary["final_eval_step"] == 4 and 0 < summary["eval_bits_per_byte"] < 8.5
    assert "--- sample" in out
    main(["info", str(tmp_path / "run")])
    assert "checkpoint-00000004" in capsys.readouterr().out
    main(
        [
            "generate",
            "--model",
            str(tmp_path / "run"),
            "--prompt",
            "import",
            "--max-new-tokens",
            "5",
        ]
    )
    assert capsys.readouterr().out.startswith("import")
    config.write_text("nope = 1\n")
    with pytest.raises(SystemExit, match="unknown keys \\['nope'\\]"):
        main(["train", "--config", str(config)])


def test_loss_curve_png(tmp_path):
    pytest.importorskip("matplotlib")
    _, summary = _run(tmp_path, steps=3)
    assert (
        summary["loss_png"] == str(tmp_path / "loss.png") and (tmp_path / "loss.png").stat().st_size
    )
