"""What every section shares: the partial-result sink, the peak rate, OOM detection and
relative error.

A section runs in a child process (``benchmarks.device.section``) and reports through a
``Sink``: every ``row`` / ``set`` rewrites the section's result file at once, so when the
driver kills a section at its time limit the rows it finished are kept.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

# bf16 dense peak of an H100 SXM (989.4 TFLOP/s, NVIDIA's datasheet, without sparsity); the
# H200 has the same tensor cores and clocks, so the same peak. MFU is against this number.
H100_BF16_PEAK_TFLOPS = 989.0
# The dry run's "peak" on CPU: only so that MFU is a number there (edl train uses 0.1 too).
CPU_PEAK_TFLOPS = 0.1


class Sink:
    """A section's results: ``meta`` (a dict) and ``rows`` (a list of dicts), written to
    ``path`` as JSON after every change (atomically: a kill never leaves half a file)."""

    def __init__(self, path: Path):
        self.path = path
        self.meta: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def set(self, **meta: Any) -> None:
        """Add or replace meta fields and write."""
        self.meta.update(meta)
        self.write()

    def row(self, row: dict[str, Any]) -> None:
        """Append one result row and write."""
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        """Write ``{"meta", "rows"}`` to ``path`` (NaN kept as JSON's NaN)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, default=str))
        os.replace(tmp, self.path)


class Deadline:
    """The end of a section's time limit (started when the section's process started), so
    that a section can skip what would not finish rather than be killed in the middle of
    it. ``margin`` seconds are kept back for writing results."""

    def __init__(self, budget: float, margin: float = 3.0):
        self.end = time.perf_counter() + budget - margin

    def left(self) -> float:
        """Seconds left."""
        return self.end - time.perf_counter()

    def allows(self, seconds: float) -> bool:
        """Whether ``seconds`` more of work fit."""
        return seconds < self.left()


def skip_note(what: str, need: float, deadline: Deadline) -> str:
    """Why ``what`` was not run: it needs about ``need`` s, fewer are left."""
    return f"{what}: needs ~{need:.0f} s, {max(0.0, deadline.left()):.0f} s left"


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an accelerator out-of-memory error (XLA's RESOURCE_EXHAUSTED)."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def short_error(err: BaseException, limit: int = 300) -> str:
    """``Type: message``, cut to ``limit`` characters (XLA errors run to pages)."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def relative_error(a: Any, b: Any) -> float:
    """``||a - b|| / ||b||`` in float64 over all leaves of ``a`` and ``b`` (arrays or
    tuples of arrays, same structure); NaN anywhere gives NaN (never a pass)."""
    xs = a if isinstance(a, tuple | list) else (a,)
    ys = b if isinstance(b, tuple | list) else (b,)
    num = den = 0.0
    for x, y in zip(xs, ys, strict=True):
        x64 = np.asarray(x, np.float64)
        y64 = np.asarray(y, np.float64)
        num += float(np.sum((x64 - y64) ** 2))
        den += float(np.sum(y64**2))
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0.0:
        return float("nan")
    return math.sqrt(num / den)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN when empty)."""
    return float(np.percentile(values, q)) if values else float("nan")
