"""``edl train`` across processes through the command line (slow: every run starts and
compiles in each process).

Two processes of four CPU devices each (``--coordinator``, gloo collectives) train the
embedded byte-level job on a mesh spanning both, checkpointing every 10 steps into one
sharded checkpoint. Killed with SIGKILL (both) after a checkpoint and resumed, the
per-step losses equal an uninterrupted two-process run's exactly; one process of eight
devices gives the same losses to 1e-4; the two processes' checkpoint resumes in one
process of eight devices and in one process of one device, and ``edl info`` / ``edl
export`` read it.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import edl
from edl.cli import main

STEPS, SAVE_EVERY, TIMEOUT_S = 40, 10, 300
TINY = [
    "--hidden-size",
    "32",
    "--intermediate-size",
    "64",
    "--num-layers",
    "1",
    "--corpus-bytes",
    "200000",
    "--eval-every",
    "0",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--sample-tokens",
    "4",
    "--save-every",
    str(SAVE_EVERY),
    "--trackers",
    "none",
    "--time-limit",
    "0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run: Path, *, processes: int, devices: int, steps: int, extra=()):
    """The ``edl train`` processes of one run (output in ``run``.N.out / .err)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }
    argv = [
        sys.executable,
        "-c",
        "from edl.cli import main; main()",
        "train",
        "--output-dir",
        str(run),
        "--steps",
        str(steps),
        *TINY,
        *extra,
    ]
    if processes > 1:
        argv += ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", str(processes)]
    procs = []
    for i in range(processes):
        rank = ["--process-id", str(i)] if processes > 1 else []
        with open(f"{run}.{i}.out", "w") as out, open(f"{run}.{i}.err", "w") as err:
            procs.append(subprocess.Popen([*argv, *rank], env=env, stdout=out, stderr=err))
    return procs


def _finish(procs, run: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed below
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if any(p.returncode != 0 for p in procs):
        logs = "\n".join(
            f"--- process {i} (exit {p.returncode}):\n{Path(f'{run}.{i}.err').read_text()[-3000:]}"
            for i, p in enumerate(procs)
        )
        raise AssertionError(f"edl train failed\n{logs}")


def _run(run: Path, **kw) -> dict[int, float]:
    procs = _launch(run, **kw)
    _finish(procs, run)
    return _losses(run)


def _losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines}


@pytest.mark.slow
def test_two_processes_kill_resume_and_restore_elsewhere(tmp_path, capsys):
    # A hybrid mesh: FSDP over each process's 4 devices, data parallel across the two.
    two = dict(processes=2, devices=4, extra=["--mesh", "1,-1,1,1/2"])
    expected = _run(tmp_path / "whole", steps=STEPS, **two)
    assert sorted(expected) == list(range(1, STEPS + 1))

    # Killed (both processes, SIGKILL) once a checkpoint is complete, then resumed.
    run = tmp_path / "killed"
    procs = _launch(run, steps=STEPS, **two)
    saved = run / "checkpoints" / f"checkpoint-{SAVE_EVERY:08d}" / "state.json"
    deadline = time.monotonic() + TIMEOUT_S
    while not saved.exists() and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            _finish(procs, run)
            raise AssertionError("the run ended before it was killed")
        time.sleep(0.05)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    assert saved.exists(), "no checkpoint within the time limit"
    resumed = _run(run, steps=STEPS, **{**two, "extra": [*two["extra"], "--resume"]})
    assert "resuming from checkpoint-" in Path(f"{run}.0.err").read_text()
    assert resumed == expected  # every step, bit for bit

    # One process of eight devices: the same maths, up to float summation order.
    single = _run(
        tmp_path / "single", steps=STEPS, processes=1, devices=8, extra=["--mesh", "1,-1,1,1"]
    )
    for step, loss in expected.items():
        assert single[step] == pytest.approx(loss, rel=1e-4), step

    # The two processes' checkpoint continues in one process: 8 devices, then 1 device.
    for devices, extra, steps in ((8, ["--mesh", "1,-1,1,1"], STEPS + 2), (1, [], STEPS + 4)):
        more = _run(run, steps=steps, processes=1, devices=devices, extra=[*extra, "--resume"])
        assert sorted(more) == list(range(1, steps + 1))
        assert {s: more[s] for s in expected} == expected

    # The two-process run's sharded checkpoint: summarised, and exported as one HF model.
    main(["info", str(tmp_path / "whole")])
    assert "sharded over 2 process(es)" in capsys.readouterr().out
    main(["export", str(tmp_path / "whole"), str(tmp_path / "exported")])
    exported = edl.from_pretrained(tmp_path / "exported")
    assert edl.count_params(exported) > 0


@pytest.mark.slow  # ~1.5 min: a two-process run and a one-process run, each compiling
def test_two_processes_on_a_mesh_with_an_expert_axis_equal_one_process(tmp_path):
    """``--mesh`` with a fifth (expert) size across two processes: fsdp 2 x expert 2 within
    each, data parallel across them; the batch is split over dp x fsdp x expert and the
    per-step losses equal one process's on 8 devices to 1e-4 (the embedded job is dense:
    this checks the mesh and the batch; tests/test_expert_parallel.py checks MoE layers)."""
    steps = 6
    two = _run(
        tmp_path / "two", steps=steps, processes=2, devices=4, extra=["--mesh", "1,2,1,1,2/2"]
    )
    one = _run(tmp_path / "one", steps=steps, processes=1, devices=8, extra=["--mesh", "1,-1,1,1"])
    assert sorted(two) == list(range(1, steps + 1))
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step
