"""Multi-process (multi-controller) training on one machine matches a single-device run.

Two worker processes (tests/sharding_worker.py) of four forced host devices each join through
``jax.distributed.initialize`` into one eight-device system (gloo CPU collectives), shard a
small Llama over meshes spanning both processes, each feed only their own half of the batch
rows through ``shard_batch`` (``make_array_from_process_local_data``), and train 3 steps. The
losses must equal those of the same model trained here on one device, without a mesh. Then
both save the last mesh's state as one checkpoint (each process its own pieces), which this
single process loads onto one device and onto a mesh of its own eight devices.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

WORKER = Path(__file__).with_name("sharding_worker.py")
NUM_PROCESSES, DEVICES_PER_PROCESS, STEPS, TIMEOUT_S = 2, 4, 3, 240


def _worker_module():
    spec = importlib.util.spec_from_file_location("sharding_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(tmp: Path, extra=()) -> list[subprocess.Popen]:
    """The workers, logging to files (pipes could fill and stall one while we wait on the
    other, which would stall both at their next collective)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        "JAX_PLATFORMS": "cpu",
    }
    port = _free_port()
    procs = []
    for i in range(NUM_PROCESSES):
        with open(tmp / f"worker{i}.out", "w") as out, open(tmp / f"worker{i}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        "--process-id",
                        str(i),
                        "--num-processes",
                        str(NUM_PROCESSES),
                        "--port",
                        str(port),
                        "--output",
                        str(tmp / "losses.json"),
                        "--steps",
                        str(STEPS),
                        "--checkpoint",
                        str(tmp / "checkpoints"),
                        *extra,
                    ],
                    env=env,
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
    return procs


def _finish_workers(procs: list[subprocess.Popen], tmp: Path) -> dict:
    """Wait (TIMEOUT_S in all) for the workers; their output and exit codes on failure."""
    deadline, timed_out = time.monotonic() + TIMEOUT_S, False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = "\n".join(
        f"--- worker {i} (exit {proc.returncode}) stdout:\n"
        f"{(tmp / f'worker{i}.out').read_text()}\n"
        f"--- worker {i} stderr:\n{(tmp / f'worker{i}.err').read_text()}"
        for i, proc in enumerate(procs)
    )
    if timed_out:
        raise AssertionError(f"workers timed out after {TIMEOUT_S} s\n{report}")
    if any(proc.returncode != 0 for proc in procs) or not (tmp / "losses.json").exists():
        raise AssertionError(f"a worker failed\n{report}")
    return json.loads((tmp / "losses.json").read_text())


def _reference(worker):
    """``(losses, state)``: the same model, optimizer and global batch on this process's
    first device."""
    state, step = worker.setup()
    batch = {"ids": jnp.asarray(worker.global_batch())}
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.slow  # two coordinated jax processes, each compiling the whole step
def test_two_processes_match_single_device(tmp_path):
    worker = _worker_module()
    procs = _start_workers(tmp_path)
    try:
        expected, reference = _reference(worker)  # while the workers compile
    finally:
        result = _finish_workers(procs, tmp_path)
    assert result["process_count"] == NUM_PROCESSES
    assert result["global_devices"] == NUM_PROCESSES * DEVICES_PER_PROCESS
    assert result["local_devices"] == DEVICES_PER_PROCESS
    assert len(set(expected)) == STEPS  # training moves the loss
    assert set(result["losses"]) == set(worker.MESHES)
    for mesh, losses in result["losses"].items():
        np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=f"mesh {mesh}")

    # The two processes' checkpoint, onto one device and onto this process's 8 devices.
    import edl
    from edl.io.checkpoint import load_state, verify_checkpoint
    from edl.io.formats.safetensors import load_file
    from edl.sharding import make_mesh, shard_state

    checkpoint = tmp_path / "checkpoints" / f"checkpoint-{STEPS:08d}"
    info = verify_checkpoint(checkpoint)
    assert info["model_files"] == ["model.process-00000", "model.process-00001"]
    like, _ = worker.setup()
    saved = load_file(tmp_path / "checkpoints" / "gathered.safetensors")
    for target in (like, shard_state(like, None, make_mesh((2, 4, 1, 1)))):
        loaded, metadata = load_state(checkpoint, target)
        assert metadata == {"steps": STEPS} and int(loaded.step) == STEPS
        for path, got in edl.tree.flatten(loaded).items():
            np.testing.assert_array_equal(np.asarray(got), saved[path], err_msg=path)
    # The model streamed out of both processes by save_pretrained: the same weights.
    exported = edl.from_pretrained(tmp_path / "checkpoints" / "hf")
    for path, got in edl.tree.flatten(exported).items():
        if hasattr(got, "shape"):
            np.testing.assert_array_equal(np.asarray(got), saved[f"params.{path}"], err_msg=path)
    # And the two-process training itself stays close to one device's. Adam scales each
    # update to about the learning rate whatever the gradient's size, so an element whose
    # gradient is at rounding level may move up to ~lr per step apart in the two runs (seen:
    # one element of the whole state, 3.7e-5 apart); every other one agrees to rounding.
    outside, total = 0, 0
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(reference), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        diff = np.abs(got - want)
        assert diff.max() <= STEPS * worker.LEARNING_RATE, diff.max()
        outside += int(np.sum(diff > 1e-5 + 1e-3 * np.abs(want)))
        total += diff.size
    assert outside <= 1e-4 * total, f"{outside} of {total} elements differ beyond rounding"


@pytest.mark.slow  # two coordinated jax processes
def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint_newest(tmp_path):
    """Process 1 dies once its pieces of step 4's checkpoint are written, before the barrier;
    process 0, waiting there, is killed too. Step 3's checkpoint stays the newest complete
    one and loads; step 4's pieces lie in a temporary directory, never renamed."""
    from edl.io.checkpoint import latest_checkpoint, list_checkpoints, load_state

    procs = _start_workers(tmp_path, ["--mesh", "1,8,1,1", "--die-in-second-save"])
    try:
        assert procs[1].wait(timeout=TIMEOUT_S) == 9, (tmp_path / "worker1.err").read_text()
        time.sleep(2)  # process 0 waits at the barrier (or has failed on the lost peer)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    checkpoints = tmp_path / "checkpoints"
    assert latest_checkpoint(checkpoints).name == f"checkpoint-{STEPS:08d}"
    assert [p.name for p in list_checkpoints(checkpoints)] == [f"checkpoint-{STEPS:08d}"]
    leftovers = list(checkpoints.glob(f".tmp-checkpoint-{STEPS + 1:08d}-*"))
    assert len(leftovers) == 1 and any(leftovers[0].glob("model.process-00001*"))
    worker = _worker_module()
    loaded, _ = load_state(checkpoints, worker.setup()[0])
    assert int(loaded.step) == STEPS
