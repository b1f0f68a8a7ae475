"""edl.train: steps (accumulation, clipping, non-finite detection and skipping), the loop
core and its callbacks, the non-finite policies and the options' checks."""

import json
import os
import signal
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.train import (
    Callback,
    CheckpointConfig,
    LogConfig,
    NonFiniteConfig,
    OptimizerConfig,
    RunConfig,
    make_eval_step,
    make_optimizer,
    make_train_step,
    train,
)
from edl.train.callbacks import NonFiniteLossError
from edl.train.core import StepInfo, Stop, callback
from edl.train.step import make_schedule


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


def test_clipping_and_learning_rate():
    model, loss_fn = _regression()
    config = OptimizerConfig(
        name="sgd",
        learning_rate=0.5,
        total_steps=10,
        momentum=0.0,
        warmup_steps=2,
        schedule="linear",
    )
    tx, schedule = make_optimizer(config)
    state = edl.create_state(model, tx)
    batch = next(_batches(1))
    step = make_train_step(loss_fn, tx, clip_norm=1e-3, schedule=schedule, donate=False)
    clipped, metrics = step(state, batch)
    np.testing.assert_allclose(metrics["learning_rate"], 0.25)  # warmup from peak / 2, not 0
    moved = edl.train.step.global_norm(jax.tree.map(jnp.subtract, clipped.params, state.params))
    assert float(moved) <= 0.25 * 1e-3 * 1.0001  # one step of lr 0.25 on a clipped gradient
    clipped, metrics = step(clipped, batch)
    np.testing.assert_allclose(metrics["learning_rate"], 0.5)  # the peak at the warmup's end
    # Then the linear decay to the floor over the other 8 steps, from the peak at step 2.
    floor = 0.5 * config.min_lr_ratio
    np.testing.assert_allclose([schedule(2), schedule(3)], [0.5, 0.5 - (0.5 - floor) / 8])


def _nan_in_masked_row(batch):
    """A finite loss with NaN gradients: ``y`` is NaN in a row the loss masks out (``where``
    selects 0 there, but its backward multiplies 0 by the NaN derivative)."""
    w = batch["w"].at[1].set(0.0)
    return {**batch, "w": w, "y": batch["y"].at[1].set(jnp.nan)}


@pytest.mark.parametrize("case", ["loss", "gradients", "updates"])
def test_nonfinite_steps_are_flagged_and_skipped_without_losing_the_step(case):
    """``nonfinite`` covers the loss, the gradients and the applied update; with
    ``skip_nonfinite`` the parameters and optimizer state stay, but the step counts."""
    model, loss_fn = _regression()
    tx = optax.adam(1e-2)
    batch = next(_batches(1))
    if case == "loss":
        batch = {**batch, "y": batch["y"].at[0].set(jnp.nan)}
    elif case == "gradients":
        batch = _nan_in_masked_row(batch)
    else:  # finite gradients, an infinite update
        tx = optax.chain(optax.adam(1e-2), optax.scale(float("inf")))
    state = edl.create_state(model, tx)
    _, metrics = make_train_step(loss_fn, tx, donate=False)(state, batch)
    assert int(metrics["nonfinite"]) == 1 and "skipped" not in metrics
    if case != "loss":
        assert np.isfinite(float(metrics["loss"]))
    skip = make_train_step(loss_fn, tx, skip_nonfinite=True, donate=False)
    after, metrics = skip(state, batch)
    assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite"]) == 1
    assert int(after.step) == int(state.step) + 1  # counted toward the run's steps
    _assert_trees_equal(after.params, state.params)
    _assert_trees_equal(after.opt_state, state.opt_state)
    if case != "updates":  # a finite batch through the same step is applied
        good, metrics = skip(state, next(_batches(1, seed=3)))
        assert int(metrics["skipped"]) == 0 and int(metrics["nonfinite"]) == 0
        assert not jax.tree.all(jax.tree.map(jnp.array_equal, good.params, state.params))


def _assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "lion", "sgd"])
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_every_optimizer_and_schedule_trains(name, schedule):
    model, loss_fn = _regression()
    config = OptimizerConfig(
        name=name, schedule=schedule, learning_rate=1e-2, warmup_steps=1, total_steps=20
    )
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


_ARGUMENTS = ("callbacks", "eval_step", "eval_data", "tokenizer", "record")
"""``train``'s arguments besides its ``RunConfig``; the rest of ``_run``'s are run options."""


def _run(tmp_path, steps=6, data=None, step=None, **kw):
    """``train`` on the regression model; ``kw``: flat run options (``save_every=2``, as
    the ``edl train`` flags) and ``train``'s own arguments."""
    model, loss_fn = _regression()
    tx = optax.adam(1e-2)
    arguments = {k: kw.pop(k) for k in _ARGUMENTS if k in kw}
    options = {"steps": steps, "output_dir": tmp_path, "progress": False, **kw}
    step = step or make_train_step(loss_fn, tx)
    return train(
        edl.create_state(model, tx),
        step,
        data or _batches(100),
        RunConfig.from_options(options),
        **arguments,
    )


def _lines(directory):
    return [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]


def test_loop_writes_metrics_checkpoints_and_summary(tmp_path, caplog):
    caplog.set_level("INFO", logger="edl.train")
    _, loss_fn = _regression()
    state, summary = _run(
        tmp_path,
        steps=6,
        save_every=2,
        eval_every=3,
        stats_every=2,
        eval_step=make_eval_step(loss_fn),
        eval_data=list(_batches(2, seed=9)),
        record={"what": "test"},
    )
    lines = _lines(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert "eval_loss" in lines[2] and "eval_loss" not in lines[0]
    assert summary["final_eval_step"] == 6
    assert summary["final_eval"] == {k: v for k, v in lines[5].items() if k.startswith("eval_")}
    assert "param_norm" in lines[1] and "param_norm" not in lines[0]
    assert all("grad_norm" in m and "time" in m and m["nonfinite"] == 0 for m in lines)
    assert int(state.step) == 6 and summary["stop_reason"] == "steps"
    assert summary["compile_seconds"] > 0 and summary["final_loss"] == lines[-1]["loss"]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint-00000002", "checkpoint-00000004", "checkpoint-00000006"]
    run_md = (tmp_path / "run.md").read_text()
    assert "final_loss" in run_md and '"what": "test"' in run_md
    # The compiles the user waits on are announced, then timed (once each).
    said = [r.getMessage() for r in caplog.records if r.name == "edl.train"]
    for what in ("the train step", "the eval step (and the first evaluation)"):
        assert said.count(f"compiling {what} ...") == 1, said
        (ready,) = [m for m in said if m.startswith(f"{what} ready in ")]
        assert ready.endswith(" s (compiled)")
    assert said.index("compiling the train step ...") < said.index(
        "compiling the eval step (and the first evaluation) ..."
    )


def test_a_step_that_compiles_inside_its_call_is_not_announced(tmp_path, caplog):
    """A plain Python step (GRPO's samples, then updates) compiles inside its first call:
    the loop cannot time that, so it says nothing rather than "ready in 0.0 s"."""
    caplog.set_level("INFO", logger="edl.train")
    _, loss_fn = _regression()
    jitted = make_train_step(loss_fn, optax.adam(1e-2))
    _run(tmp_path, steps=2, step=lambda state, batch: jitted(state, batch))
    said = [r.getMessage() for r in caplog.records if r.name == "edl.train"]
    assert not [m for m in said if "the train step" in m], said


def test_log_every_sets_the_metrics_interval(tmp_path):
    """Every ``log_every`` steps and the last, plus every evaluated step, are logged."""
    _, loss_fn = _regression()
    evaluation = {"eval_step": make_eval_step(loss_fn), "eval_data": list(_batches(1, seed=9))}
    _, summary = _run(tmp_path, steps=7, log_every=3, eval_every=2, **evaluation)
    assert [m["step"] for m in _lines(tmp_path)] == [2, 3, 4, 6, 7]
    assert summary["first_loss"] == _lines(tmp_path)[0]["loss"]


class _Recorder(Callback):
    """Sees every second step; adds a metric; stops the run at ``stop_at``."""

    every = 2

    def __init__(self, stop_at=None):
        self.seen, self.stop_at, self.ended = [], stop_at, None

    def metrics(self, info):
        return {"doubled": 2 * info.metrics["loss"]}

    def on_step(self, info):
        self.seen.append((info.step, int(info.state.step), info.metrics["doubled"]))
        with pytest.raises(TypeError):
            info.metrics["loss"] = 0.0  # read-only
        with pytest.raises(AttributeError):
            info.step = 0  # frozen
        return Stop("enough") if info.step == self.stop_at else None

    def on_end(self, end):
        self.ended = (end.reason, end.last.step)


def test_user_callbacks_run_every_n_steps_see_immutable_steps_and_can_stop(tmp_path):
    recorder, calls = _Recorder(), []
    _run(tmp_path / "a", steps=5, callbacks=[recorder, callback(calls.append, every=4)])
    assert [s for s, _, _ in recorder.seen] == [2, 4, 5]  # multiples of 2, and the last
    assert all(step == state_step for step, state_step, _ in recorder.seen)
    assert [info.step for info in calls] == [4, 5] and isinstance(calls[0], StepInfo)
    assert isinstance(calls[0].metrics, types.MappingProxyType)
    lines = _lines(tmp_path / "a")
    assert lines[1]["doubled"] == 2 * lines[1]["loss"] and "doubled" not in lines[0]
    assert recorder.ended == ("steps", 5)

    stopper = _Recorder(stop_at=4)
    state, summary = _run(tmp_path / "b", steps=50, save_every=10, callbacks=[stopper])
    assert summary["stop_reason"] == "enough" and int(state.step) == 4
    assert stopper.ended == ("enough", 4)
    assert edl.io.checkpoint.latest_checkpoint(tmp_path / "b" / "checkpoints").name.endswith("4")
    with pytest.raises(TypeError, match="Callback"):  # beartype, or train's own check
        _run(tmp_path / "c", callbacks=[lambda info: None])


def _poisoned(batches, at, poison):
    for i, batch in enumerate(batches, 1):
        yield poison(batch) if i in at else batch


@pytest.mark.parametrize("case", ["loss", "gradients"])
def test_stop_policy_never_applies_or_saves_a_nonfinite_step(tmp_path, case):
    """A finite loss with NaN gradients stops the run like a NaN loss does, before it is
    saved: the newest checkpoint is the last good state."""
    poison = {"loss": lambda b: {**b, "y": b["y"] * jnp.nan}, "gradients": _nan_in_masked_row}
    data = _poisoned(_batches(100), {5}, poison[case])
    with pytest.raises(NonFiniteLossError, match=r"step 5 is non-finite.*checkpoint-00000004"):
        _run(tmp_path, steps=8, save_every=2, data=data)
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in edl.io.checkpoint.list_checkpoints(checkpoints)][-1].endswith("4")
    model, _ = _regression()
    like = edl.create_state(model, optax.adam(1e-2))
    saved, _ = edl.io.checkpoint.load_state(checkpoints, like)
    assert int(saved.step) == 4
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(saved))


def test_skip_policy_counts_skipped_steps_and_stops_after_too_many(tmp_path):
    model, loss_fn = _regression()
    tx = optax.sgd(1e-2)
    step = make_train_step(loss_fn, tx, skip_nonfinite=True)
    nan = lambda b: {**b, "y": b["y"] * jnp.nan}
    state, summary = train(
        edl.create_state(model, tx),
        step,
        _poisoned(_batches(20), {2}, nan),
        RunConfig(
            steps=8,
            output_dir=tmp_path / "a",
            nonfinite=NonFiniteConfig(policy="skip"),
            log=LogConfig(progress=False),
        ),
    )
    assert int(state.step) == 8 and summary["skipped_steps"] == 1  # a run of 8 ends at 8
    assert [m["skipped"] for m in _lines(tmp_path / "a")] == [0, 1, 0, 0, 0, 0, 0, 0]
    state, again = train(
        state,
        step,
        _batches(20),
        RunConfig(
            steps=8,
            output_dir=tmp_path / "a",
            nonfinite=NonFiniteConfig(policy="skip"),
            log=LogConfig(progress=False),
        ),
    )
    assert again["stop_reason"] == "already done" and int(state.step) == 8

    model, _ = _regression()  # the run above donated the old model's arrays
    with pytest.raises(NonFiniteLossError, match=r"3 steps in a row \(3-5\).*since step 2"):
        train(
            edl.create_state(model, tx),
            step,
            _poisoned(_batches(20), {3, 4, 5}, nan),
            RunConfig(
                steps=8,
                nonfinite=NonFiniteConfig(policy="skip", max_consecutive_skips=3),
                log=LogConfig(progress=False),
            ),
        )
    model, _ = _regression()
    with pytest.raises(ValueError, match="skip_nonfinite=True"):  # at the first step, no NaN
        train(
            edl.create_state(model, tx),
            make_train_step(loss_fn, tx),
            _batches(20),
            RunConfig(
                steps=4, nonfinite=NonFiniteConfig(policy="skip"), log=LogConfig(progress=False)
            ),
        )


def _untouchable():
    raise AssertionError("the data was read before the options were checked")
    yield


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nan_policy": "ignore"}, "nan_policy must be one of stop, skip; got 'ignore'"),
        ({"log_every": 0}, "log_every must be >= 1, got 0"),
        ({"log_every": 1.5}, "log_every must be an int, got 1.5"),
        ({"keep": -1}, "keep must be >= 0, got -1"),
        ({"time_limit": -1.0}, "time_limit must be >= 0, got -1.0"),
        ({"eval_every": 2}, "eval_every > 0 needs eval_step and eval_data"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips must be >= 1, got 0"),
        ({"resume": True, "overwrite": True}, "resume and overwrite exclude each other"),
        ({"output_dir": None, "save_every": 2}, "save_every > 0 needs an output_dir"),
        ({"output_dir": None, "trackers": "wandb"}, "trackers needs an output_dir"),
        ({"sav_every": 2}, "unknown option 'sav_every'; options: eval_batches, eval_every"),
    ],
)
def test_options_are_checked_before_any_work(tmp_path, options, message):
    # Under the suite's beartype hook, a Literal annotation may answer first (a TypeError).
    if "nan_policy" in options:
        message = "nan_policy"
    with pytest.raises((ValueError, TypeError), match=message):
        _run(tmp_path, data=_untouchable(), **options)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(("field", "value"), [("name", "adam"), ("schedule", "step")])
def test_optimizer_config_names_its_choices_up_front(field, value):
    # Under the suite's beartype hook the Literal annotation answers first (a TypeError).
    with pytest.raises((ValueError, TypeError), match=f"'{value}'"):
        OptimizerConfig(**{field: value})
    with pytest.raises(ValueError, match=r"OptimizerConfig.b2 must be \[0.0, 1.0\], got 1.5"):
        OptimizerConfig(b2=1.5)


def test_time_limit_and_sigterm_save_before_returning(tmp_path, caplog):
    caplog.set_level("INFO", logger="edl.train")
    state, summary = _run(tmp_path / "time", steps=50, time_limit=1e-9)
    assert summary["stop_reason"] == "time_limit" and int(state.step) == 1
    assert (tmp_path / "time" / "checkpoints" / "checkpoint-00000001" / "state.json").exists()
    assert "time limit of 1e-09 s reached at step 1 of 50" in caplog.text
    assert "saved checkpoint-00000001 (step 1)" in caplog.text

    def term(info):
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    # Sent by a callback after the SIGTERM callback looked at step 2: seen after step 3.
    state, summary = _run(tmp_path / "term", steps=50, callbacks=[callback(term)])
    assert summary["stop_reason"] == "sigterm" and int(state.step) == 3
    assert (tmp_path / "term" / "checkpoints" / "checkpoint-00000003" / "state.json").exists()
    assert "SIGTERM received: stopping after step 3 of 50" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_data_running_out_ends_the_run_and_saves(tmp_path):
    state, summary = _run(tmp_path, steps=10, data=_batches(4))
    assert summary["stop_reason"] == "data exhausted" and int(state.step) == 4
    assert edl.io.checkpoint.latest_checkpoint(tmp_path / "checkpoints").name.endswith("4")


def test_loss_curve_png(tmp_path):
    pytest.importorskip("matplotlib")
    _, summary = _run(tmp_path, steps=3)
    assert summary["loss_png"] == str(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size


class _Prune(Callback):
    """Zeroes the first layer's first input column after every step (a pruning mask) and
    records what ``before_step`` saw."""

    def __init__(self, dtype=None, host=False):
        self.before, self.dtype, self.host = [], dtype, host

    def before_step(self, start):
        self.before.append((start.step, int(start.state.step), start.steps))

    def replace_state(self, info):
        weight = info.state.params.layers[0].weight
        pruned = weight.at[:, 0].set(0.0).astype(self.dtype or weight.dtype)
        state = eqx.tree_at(lambda s: s.params.layers[0].weight, info.state, pruned)
        return jax.tree.map(np.array, state) if self.host else state  # host: placed back


def _column(state):
    return np.asarray(state.params.layers[0].weight[:, 0])  # a copy: the buffers are donated


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_hooks_at_both_ends_of_a_step_keep_the_compiled_step(tmp_path, host):
    """``before_step`` sees the state each step takes; ``replace_state``'s state is what the
    next step, later callbacks and checkpoints get (arrays returned on the host are placed
    back); the step is traced and compiled once."""
    model, loss_fn = _regression()
    traces = []

    def counted(model, batch):
        traces.append(1)
        return loss_fn(model, batch)

    tx = optax.adam(1e-2)
    prune, seen = _Prune(host=host), []
    state, _ = train(
        edl.create_state(model, tx),
        make_train_step(counted, tx),
        _batches(100),
        RunConfig(
            steps=4,
            output_dir=tmp_path,
            log=LogConfig(progress=False),
            checkpoint=CheckpointConfig(every=2),
        ),
        callbacks=[prune, callback(lambda i: seen.append(_column(i.state)))],
    )
    assert prune.before == [(1, 0, 4), (2, 1, 4), (3, 2, 4), (4, 3, 4)]
    assert len(traces) == 1  # compiled ahead of time once, never retraced
    assert not np.any(np.asarray(state.params.layers[0].weight[:, 0]))
    assert len(seen) == 4 and not np.any(seen)  # later callbacks see the replacement
    saved, _ = edl.io.checkpoint.load_state(tmp_path / "checkpoints" / "checkpoint-00000002", state)
    assert not np.any(np.asarray(saved.params.layers[0].weight[:, 0]))
    assert np.any(np.asarray(saved.params.layers[0].weight[:, 1]))


def test_a_replacement_the_compiled_step_cannot_take_is_named(tmp_path):
    named = r"_Prune\.replace_state: .*layers\[0\]\.weight.* float16.*float32"
    with pytest.raises(ValueError, match=named):
        _run(tmp_path / "a", steps=2, callbacks=[_Prune(dtype=jnp.float16)])

    class Wrong(Callback):
        def replace_state(self, info):
            return info.state.params

    with pytest.raises(ValueError, match=r"Wrong\.replace_state must return a TrainState"):
        _run(tmp_path / "b", steps=2, callbacks=[Wrong()])


@pytest.mark.parametrize("warmup", [1, 3, 10])
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_never_gives_a_step_learning_rate_zero(warmup, schedule):
    config = OptimizerConfig(
        schedule=schedule, learning_rate=2e-4, warmup_steps=warmup, total_steps=warmup + 10
    )
    lr = make_schedule(config)
    rates = np.array([float(lr(k)) for k in range(warmup + 1)])
    expected = 2e-4 * np.minimum(np.arange(1, warmup + 2), warmup) / warmup
    np.testing.assert_allclose(rates, expected, rtol=1e-6)  # peak * (k + 1) / warmup, then peak
