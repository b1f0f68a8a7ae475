"""benchmarks/device: the prepared GPU run, exercised on the CPU by its dry run.

``bash benchmarks/device/run.sh --dry-run`` runs every section's code path with tiny shapes
(in two processes at once, under a minute on two cores); the report must hold every
section with real numbers. The driver's time-box (a section killed at its limit keeps its
rows) and pytest-output parsing are checked directly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root off
    sys.path.insert(0, str(ROOT))

from benchmarks.device import run as driver  # noqa: E402
from benchmarks.device.common import Sink  # noqa: E402
from benchmarks.device.env import parse_pytest  # noqa: E402
from benchmarks.device.section import SECTIONS  # noqa: E402


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _dry_run(out: Path) -> subprocess.CompletedProcess:
    """``run.sh --dry-run`` into ``out``."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("XLA_FLAGS", None)  # conftest's 8 host devices: not what a plain run sees
    cmd = ["bash", "benchmarks/device/run.sh", "--dry-run", "--budget", "150"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _check_run(out: Path, done: subprocess.CompletedProcess) -> dict:
    """Every section ran to the end with rows and a headline; the summary table is printed
    last and kept in run.log. Returns the sections."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "device.json").read_text())
    assert report["run"]["finished"] and report["run"]["dry_run"]
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] == "ok", (name, section)
        assert section["rows"] and section["meta"].get("headline"), (name, section)
        assert not section["meta"].get("skipped"), (name, section)
    summary = done.stdout.strip().splitlines()[-len(SECTIONS) - 2 :]
    assert summary[0].split() == ["section", "status", "s", "headline"]
    assert (out / "run.log").read_text().strip().endswith(done.stdout.strip().splitlines()[-1])
    return report["sections"]


def _check_numbers(sections: dict, out: Path) -> None:
    """The numbers the dry run must produce are there and finite."""
    env = sections["environment"]
    assert env["rows"][0]["backend"] == "cpu" and env["meta"]["packages"]["jax"]
    tests = sections["tests"]["rows"][0]
    # 0: gpu tests collected; 5: none marked yet; 4: the marker is not registered (pytest
    # refuses an unknown marker in -m under --strict-markers).
    assert tests["exit_code"] in (0, 4, 5), tests
    assert tests["exit_code"] != 0 or tests["collected"] > 0, tests
    assert (out / "tests.log").read_text()
    attention = sections["attention"]["rows"]
    assert {r["impl"] for r in attention} == {"pallas", "xla"} and len(attention) == 4
    for row in attention:
        for key in ("fwd_tflops", "fwd_bwd_tflops", "fwd_rel_err", "grad_rel_err"):
            assert _finite(row[key]), (key, row)
        assert row["check"] == "pass", row
    train = sections["train"]["rows"]
    assert [r["remat"] for r in train] == ["none", "dots", "full"]
    for row in train:
        assert all(_finite(row[k]) and row[k] > 0 for k in ("tokens_per_s", "mfu", "compile_s"))
    assert len(sections["decode"]["rows"]) == 2
    for row in sections["decode"]["rows"]:
        assert _finite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
    serve = sections["serve"]["rows"][-1]
    assert _finite(serve["tokens_per_s"]) and _finite(serve["ttft_p50_s"]), serve
    assert serve["output_tokens"] == serve["requests"] * serve["max_tokens"]
    assert serve["recompiled"] is False


@pytest.mark.slow  # every section on the CPU, two at a time (~30-45 s)
def test_dry_run(tmp_path):
    """One test (so pytest-xdist never runs the dry run twice): run.sh --dry-run writes
    device.json with every section's numbers and device.md with their tables."""
    done = _dry_run(tmp_path)
    sections = _check_run(tmp_path, done)
    _check_numbers(sections, tmp_path)
    text = (tmp_path / "device.md").read_text()
    assert "| section | status | seconds | budget s | headline |" in text
    for name in SECTIONS:
        assert f"## {name}" in text
    assert "| seq | batch | impl | fwd_ms |" in text


def test_killed_section_keeps_its_rows(tmp_path):
    """A section past its limit is stopped (its process group) and its finished rows kept."""
    result = tmp_path / "slow.json"
    sink = Sink(result)
    sink.row({"done": 1})
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    job = driver.Running("slow", proc, time.perf_counter(), 0.2, result)
    assert driver.poll(job) is None
    time.sleep(0.3)
    record = driver.poll(job)
    assert record["status"].startswith("timed out") and record["rows"] == [{"done": 1}]
    assert proc.poll() is not None


def test_section_limit():
    # Nominal budget while later sections need the rest; slack flows to the current one;
    # never past the deadline.
    assert driver.section_limit(100, remaining=500, later=400) == 100
    assert driver.section_limit(100, remaining=600, later=400) == 600 - driver.MARGIN - 400
    assert driver.section_limit(100, remaining=50, later=400) == 50 - driver.MARGIN


def test_parse_pytest():
    assert parse_pytest("..F\n= 2 passed, 1 failed, 9 deselected in 3.1s =") == {
        "passed": 2,
        "failed": 1,
        "deselected": 9,
    }
    assert parse_pytest("a\n3/1027 tests collected (1024 deselected) in 9.0s")["collected"] == 3
    assert parse_pytest("1 error in 0.5s")["errors"] == 1
    # Killed before the summary: the progress characters.
    assert parse_pytest("..s.F [ 40%]\n..E\n") == {
        "passed": 5,
        "skipped": 1,
        "failed": 1,
        "errors": 1,
    }
