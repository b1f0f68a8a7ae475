"""Sections 1 and 2: the environment (versions, device, driver, commit, wheels) and the
GPU-marked tests (``pytest -m gpu``; the dry run only collects them)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.device.common import Deadline, Sink

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda12-plugin",
    "equinox",
    "optax",
    "jaxtyping",
    "beartype",
    "numpy",
    "einops",
    "starlette",
    "uvicorn",
    "pytest",
    "transformers",
    "torch",
)
# Environment variables that change what runs, recorded as found.
ENV_VARS = (
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
    "EDL_NATIVE_KERNELS",
)
# pytest's outcome words in its summary line ("3 passed, 1 failed, 10 deselected in 4s").
OUTCOMES = ("passed", "failed", "errors", "error", "skipped", "deselected", "xfailed", "xpassed")


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    """``cmd``'s stripped stdout, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _versions() -> dict[str, str | None]:
    """Installed versions of ``PACKAGES`` (None: not installed)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def tree_digest() -> str:
    """A short sha256 of ``edl/`` and ``benchmarks/`` sources (paths and contents): names
    the code that ran where no git metadata travelled with the tree."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("edl/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cuda_versions() -> dict[str, Any]:
    """CUDA runtime / cuDNN / cuBLAS versions as jaxlib reports them (empty off CUDA)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    names = (
        "cuda_runtime_get_version",
        "cuda_runtime_build_version",
        "cudnn_get_version",
        "cudnn_build_version",
        "cublas_get_version",
        "cuda_driver_get_version",
    )
    found = {}
    for name in names:
        with contextlib.suppress(Exception):
            found[name.replace("_get", "")] = getattr(cuda_versions, name)()
    return found


def _device_row() -> dict[str, Any]:
    """Backend, device kind and count, memory limit and compute capability of device 0."""
    import jax

    device = jax.devices()[0]
    stats = {}
    with contextlib.suppress(Exception):
        stats = device.memory_stats() or {}
    return {
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "devices": jax.device_count(),
        "memory_gib": stats.get("bytes_limit", 0) / 2**30,
        "compute_capability": getattr(device, "compute_capability", None),
    }


def run_environment(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 1: what ran, where: versions, device, driver, CUDA, commit, wheels."""
    import jax

    smi = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
            "--format=csv,noheader",
        ]
    )
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        jax.print_environment_info()
    commit = _run(["git", "rev-parse", "HEAD"])  # None where no .git travelled
    row = _device_row()
    row["driver"] = smi.split(",")[1].strip() if smi and smi.count(",") >= 1 else None
    sink.row(row)
    sink.set(
        python=sys.version.split()[0],
        platform=platform.platform(),
        packages=_versions(),
        wheels=os.environ.get("EDL_DEVICE_WHEELS", "not run through run.sh"),
        git_commit=commit,
        git_dirty=None
        if commit is None
        else bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
        tree_digest=tree_digest(),
        nvidia_smi=smi,
        cuda=_cuda_versions(),
        env={k: os.environ.get(k) for k in ENV_VARS},
        environment_info=buffer.getvalue(),
        dry_run=dry,
        headline=f"{row['device']} x{row['devices']}, jax {jax.__version__}, "
        f"driver {row['driver']}",
    )


# The gpu-marked tests' environment: few hypothesis examples (conftest's "device" profile),
# float32 products in float32 (jax's default on GPUs is TF32, which the float32 tolerances
# and fp32 model parity do not allow), GPU memory taken as needed by the four workers.
TEST_ENV = {
    "EDL_HYPOTHESIS_PROFILE": "device",
    "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}


def gpu_marker_registered() -> bool:
    """Whether pyproject.toml's pytest markers include ``gpu``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = config.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("markers", [])
    return any(m.split(":")[0].strip() == "gpu" for m in markers)


def parse_pytest(output: str) -> dict[str, int]:
    """Outcome counts from pytest's output: the summary line, the collect-only line
    ("3/1027 tests collected (1024 deselected)"), or, for a run killed before its
    summary, the ``-q`` progress characters (``.`` passed, ``F`` failed, ``E`` error,
    ``s`` skipped)."""
    lines = output.strip().splitlines()
    counts: dict[str, int] = {}
    collected = re.search(r"(\d+)(?:/(\d+))? tests? collected", output)
    if collected:
        counts["collected"] = int(collected.group(1))
    summary = next((ln for ln in reversed(lines) if re.search(r" in [\d.]+s", ln)), "")
    for number, word in re.findall(r"(\d+) (" + "|".join(OUTCOMES) + r")\b", summary):
        counts["errors" if word == "error" else word] = int(number)
    if not summary:  # killed: count the progress characters
        progress = [ln for ln in lines if re.fullmatch(r"[.FEsxX]+\s*(\[\s*\d+%\])?", ln.strip())]
        chars = "".join(ln.split("[")[0].strip() for ln in progress)
        for char, word in (".", "passed"), ("F", "failed"), ("E", "errors"), ("s", "skipped"):
            if chars.count(char):
                counts[word] = chars.count(char)
    return counts


def run_tests(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 2: ``pytest -m "gpu and not slow"`` bounded by ``timeout`` (the dry run:
    ``--collect-only``); the output's tail to ``out/tests.log``, counts parsed."""
    limit = max(5, int(deadline.left() - 5))  # time to parse and write before the driver's kill
    # --foreground: timeout stays in this process group, so the driver's kill of the
    # section reaches pytest too (by default timeout makes a group of its own).
    cmd = [
        "timeout",
        "--foreground",
        "-k",
        "5",
        str(limit),
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu and not slow",
        "-q",
        "--maxfail=25",
        "-p",
        "no:cacheprovider",
        "--durations=15",
    ]
    if dry:
        cmd.append("--collect-only")
    else:  # four workers share the GPU (memory taken as needed, not preallocated)
        cmd += ["-n", "4", "--dist", "loadfile"]
    registered = gpu_marker_registered()
    sink.set(command=" ".join(cmd[5:]), timeout_s=limit, gpu_marker_registered=registered)
    start = time.perf_counter()
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        env={**os.environ, **TEST_ENV},
    )
    seconds = time.perf_counter() - start
    (out / "tests.log").write_text(done.stdout[-400_000:])
    counts = parse_pytest(done.stdout)
    status = {
        0: "passed",
        1: "failed",
        2: "interrupted",
        4: "usage error",
        5: "no tests collected",
        124: "timed out",
        137: "killed",
    }.get(done.returncode, f"exit {done.returncode}")
    if "Unknown marker" in done.stdout:
        status += " (marker gpu not registered in pyproject.toml)"
    row = {"exit_code": done.returncode, "status": status, "seconds": seconds}
    row.update(
        {
            w: counts.get(w, 0)
            for w in ("collected", "passed", "failed", "errors", "skipped", "deselected")
        }
    )
    sink.row(row)
    shown = "collected" if dry else "passed"
    sink.set(
        headline=f"{status}: {row[shown]} {shown}, {row['failed']} failed, {row['errors']} errors"
    )
