"""The code base stays ruff-clean (configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (it comes with the 'test' extra)")
    result = subprocess.run(
        [exe, "check", "edl", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
