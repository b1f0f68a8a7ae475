"""The device run's driver: each section in its own process, time-boxed, the report rewritten
after every section, a short summary table printed last.

    python -m benchmarks.device.run [--dry-run] [--budget 540] [--out DIR] [--sections a,b]

Use ``benchmarks/device/run.sh`` (it installs the carried wheels, sets the environment and
keeps the log); ``README.md`` beside this file says how to call it on a lent GPU.

Time: the whole run ends within ``--budget`` seconds. A section gets its nominal budget
(``BUDGETS``), plus whatever earlier sections left unused as long as every later section
keeps its own. Within it, a section skips the measurements that would not fit (its meta's
``skipped`` says which); at the limit it is killed (its process group) and recorded as timed
out, with the rows it had finished. A section that fails is recorded with its error; the next
one runs either way. On the GPU the sections run one at a time (``--jobs 1``: each has the
device to itself); the dry run, on the CPU, runs two at once and shares a compilation
cache between them (``_dry_env``) to stay under a minute on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import table
from benchmarks.device import report
from benchmarks.device.section import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
# Nominal seconds per section on the GPU (process start and jax's CUDA init included):
# 520 of the default 540 s budget; the rest is slack for the driver. The first H200 runs
# (2026-11-27, benchmarks/RESULTS.md) took 3 / 106-178+ / 34 / 27 / 34 / 25 s: the tests
# (a growing set) get what the measured sections leave, with about 1.5x margin on those.
BUDGETS = {
    "environment": 15,
    "tests": 305,
    "attention": 50,
    "train": 50,
    "decode": 55,
    "serve": 45,
}
DRY_BUDGETS = dict.fromkeys(SECTIONS, 45)
# One section at a time has the GPU: let jax take 92% of its memory rather than its default
# 75% (the 1B train step without remat needs ~50 GB); an explicit setting wins.
GPU_ENV = {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
}
MARGIN = 3.0  # seconds kept back per section for killing it and writing the report
MIN_SECTION = 5.0  # a section with less time left than this is skipped


@dataclasses.dataclass
class Running:
    """A section's child process and its time limit."""

    name: str
    proc: subprocess.Popen
    start: float
    limit: float
    result: Path


def section_limit(nominal: float, remaining: float, later: float) -> float:
    """A section's time limit: its ``nominal`` budget, or more when the run is ahead of
    plan (``remaining`` minus what ``later`` sections are owed), never past the deadline."""
    return min(remaining - MARGIN, max(nominal, remaining - MARGIN - later))


def _stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``'s process group (it was started as its own session), then kill
    it if it has not ended within 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _dry_env(scratch: Path) -> dict[str, str]:
    """The dry run's environment: the CPU, and one persistent compilation cache for all
    its sections (the model's initialisation compiles ~40 small programs, ~5 s of the
    CPU, which the later sections then load instead). The GPU run uses neither."""
    return {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(scratch / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _start(name: str, limit: float, args: argparse.Namespace, scratch: Path) -> Running:
    """Start section ``name`` in a child process (its own session, so that it and its
    children can be stopped together) with ``limit`` seconds to run."""
    result = scratch / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.device.section",
        name,
        "--result",
        str(result),
        "--out",
        str(args.out),
        "--budget",
        f"{limit:.0f}",
        *(["--dry-run"] if args.dry_run else []),
    ]
    env = {**os.environ, **(_dry_env(scratch) if args.dry_run else GPU_ENV)}
    print(f"== {name}: started (limit {limit:.0f} s)", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    return Running(name, proc, time.perf_counter(), limit, result)


def _record(running: Running, code: int | None, status: str | None = None) -> dict[str, Any]:
    """A finished (``code``) or killed (``None``) section's record: status, seconds,
    budget, error, meta and rows (what it finished, even when killed)."""
    seconds = time.perf_counter() - running.start
    if status is None and code is None:
        status = f"timed out (killed at {running.limit:.0f} s)"
    elif status is None:
        status = "ok" if code == 0 else f"error (exit {code})"
    try:
        data = json.loads(running.result.read_text())
    except (OSError, ValueError):
        data = {"meta": {}, "rows": []}
    meta = data.get("meta", {})
    print(f"== {running.name}: {status} in {seconds:.1f} s", flush=True)
    return {
        "status": status,
        "seconds": seconds,
        "budget_s": round(running.limit),
        "error": meta.pop("error", None),
        "meta": meta,
        "rows": data.get("rows", []),
    }


def poll(job: Running) -> dict[str, Any] | None:
    """``job``'s record once it has ended, or once it is past its limit (then it is
    stopped first); None while it runs within its limit."""
    code = job.proc.poll()
    if code is None and time.perf_counter() - job.start <= job.limit:
        return None
    if code is None:
        _stop(job.proc)
    return _record(job, code)


def run_sections(
    args: argparse.Namespace, state: dict[str, Any], deadline: float, scratch: Path
) -> None:
    """Run ``args.sections`` in order, ``args.jobs`` at a time, each within its limit
    (``section_limit``; later sections' budgets shared among the jobs); the report is
    rewritten as each ends."""
    budgets = DRY_BUDGETS if args.dry_run else BUDGETS
    pending, running = list(args.sections), []
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                name = pending.pop(0)
                later = sum(budgets[n] for n in pending) / args.jobs
                limit = section_limit(budgets[name], deadline - time.perf_counter(), later)
                if limit >= MIN_SECTION:
                    running.append(_start(name, limit, args, scratch))
                    continue
                state["sections"][name]["status"] = "skipped (no time left)"
                report.write(state, args.out)
            time.sleep(0.05)
            for job in list(running):
                record = poll(job)
                if record is not None:
                    state["sections"][job.name] = record
                    state["run"]["elapsed_s"] = time.perf_counter() - deadline + args.budget
                    running.remove(job)
                    report.write(state, args.out)
    finally:  # the driver itself was stopped: no section may outlive it
        for job in running:
            _stop(job.proc)
            state["sections"][job.name] = _record(job, None, "stopped with the driver")
        report.write(state, args.out)


class Stopped(Exception):
    """SIGTERM reached the driver (``run.sh``'s outer ``timeout``, say)."""


def _on_signal(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="every section on the CPU with tiny shapes (< 60 s)"
    )
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    default_out = os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "device")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default_out),
        help="the report's folder (default $OUT, else benchmarks/results/device)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="sections at once (default 1; 2 in a dry run)"
    )
    return parser


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.jobs = args.jobs or (2 if args.dry_run else 1)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sections in order within the budget; write the report after each."""
    args = _arguments(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + args.budget
    state: dict[str, Any] = {
        "run": {
            "dry_run": args.dry_run,
            "budget_s": args.budget,
            "finished": False,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "argv": sys.argv[1:],
        },
        "sections": {name: {"status": "pending", "meta": {}, "rows": []} for name in args.sections},
    }
    report.write(state, args.out)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        with tempfile.TemporaryDirectory(prefix="edl-device-") as scratch:
            run_sections(args, state, deadline, Path(scratch))
        state["run"]["finished"] = True
    except (Stopped, KeyboardInterrupt) as err:
        state["run"]["stopped_by"] = str(err) or type(err).__name__
    state["run"]["elapsed_s"] = time.perf_counter() - start
    report.write(state, args.out)
    rows = [[n, s, sec, hl[:90]] for n, s, sec, _, hl in report.summary_rows(state)]
    print(
        f"\nedl device run ({'dry run' if args.dry_run else 'full'}), "
        f"{state['run']['elapsed_s']:.0f} s, report in {args.out}"
    )
    print(table(["section", "status", "s", "headline"], rows))
    return 0 if state["run"]["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
