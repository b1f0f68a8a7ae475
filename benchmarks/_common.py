"""Shared benchmark plumbing: timing, tables and JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def time_call(
    fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 7, number: int = 20
) -> float:
    """Median seconds per call of ``fn`` (blocked until ready) over ``repeats`` x ``number``."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def interleaved_rounds(
    calls: dict[str, Callable[[], Any]],
    rounds: int,
    *,
    pause_after: Collection[str] = (),
    warm_each: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls`` (blocked until ready), one call each per round,
    rounds interleaved so that drifting load on a shared machine hits every variant alike;
    0.5 s of sleep after each call named in ``pause_after``. ``warm_each``: run each call
    once, untimed, right before its timed call. On this VM work that starts after an idle
    gap (>= 0.5 s) runs up to 1.5x slower for its first ~100 ms, and work right after torch
    competes with its spinning OpenMP workers; without the warm call, whichever variant
    follows a pause (or torch) pays for it."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if warm_each:
                jax.block_until_ready(call())
            start = time.perf_counter()
            jax.block_until_ready(call())
            samples[name].append(time.perf_counter() - start)
            if name in pause_after:
                time.sleep(0.5)
    return samples


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [
        [str(h) for h in header],
        *[[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows],
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(name: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()][:1],
        "machine": platform.machine(),
        **meta,
        "rows": rows,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    return path


def byte_llama_config(hidden: int, layers: int, max_len: int) -> Any:
    """The serving benchmarks' model: a byte-level Llama (``edl.train.ByteTokenizer``'s
    vocabulary) of ``hidden`` width and ``layers`` layers, 64-wide heads, 2 query heads per
    KV head, an MLP of 8/3 the width."""
    from edl.models import LlamaConfig
    from edl.train import ByteTokenizer

    return LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=max_len,
    )
