"""Section 3: ``edl.ops.attention`` forward and forward+backward TFLOP/s, impl against impl.

Causal, one fixed number of tokens per call (batch = tokens // seq), FLOPs counted as
``benchmarks/attention.py`` counts them (forward ``4 * b * h * s * s * d / 2`` causal;
forward+backward 3.5x that). Each cell: a first call (compile + run, timed apart), then
the median of ``repeats`` timings of ``number`` calls each, blocked until ready
(``benchmarks._common.time_call``). Per sequence length the impls' outputs (and the
gradients of ``sum(out)``) are compared with each other, so a fast wrong kernel shows as a
failed check. An out-of-memory cell is NaN, any other error of a cell is recorded; neither
stops the section.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.device.common import (
    Deadline,
    Sink,
    is_oom,
    relative_error,
    short_error,
    skip_note,
)

# Relative error between two impls above which a check fails: each bf16 output carries
# ~4e-3 of rounding (METHOD.md: bf16 operands land between 1e-3 and 1e-2).
TOLERANCE = {"bfloat16": {"fwd": 2e-2, "grad": 5e-2}, "float32": {"fwd": 1e-3, "grad": 1e-3}}


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """What the section sweeps."""

    impls: tuple[str, ...]
    seqs: tuple[int, ...]
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    repeats: int
    number: int


GPU = AttentionShapes(
    ("pallas", "cudnn"),
    (1024, 2048, 4096, 8192, 16384),
    16384,
    16,
    128,
    "bfloat16",
    repeats=5,
    number=5,
)
# On CPU: the interpreted Pallas kernel (the GPU kernel's code path) against XLA's form.
DRY = AttentionShapes(("pallas", "xla"), (128, 256), 512, 2, 32, "float32", repeats=2, number=1)


def _functions(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Jitted ``(forward, gradient of sum(forward) w.r.t. q, k, v)`` for ``impl``."""
    import jax
    import jax.numpy as jnp

    from edl.ops import attention

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True, impl=impl).astype(jnp.float32))

    forward = jax.jit(functools.partial(attention, causal=True, impl=impl))
    return forward, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _time(fn: Callable[[], Any], shapes: AttentionShapes) -> tuple[float, float, Any]:
    """``(first call s, median s per call, first call's output)``; NaN times on OOM."""
    import jax

    from benchmarks._common import time_call

    try:
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        first = time.perf_counter() - start
        median = time_call(fn, warmup=1, repeats=shapes.repeats, number=shapes.number)
    except Exception as err:
        if not is_oom(err):
            raise
        return float("nan"), float("nan"), None
    return first, median, result


def _cell(impl: str, qkv: tuple, flops: float, shapes: AttentionShapes) -> tuple[dict, Any]:
    """One impl at one shape: its row (times, TFLOP/s) and its ``(out, grads)``."""
    forward, gradient = _functions(impl)
    row: dict[str, Any] = {"impl": impl}
    outputs = [None, None]
    try:
        for i, (name, fn, count) in enumerate(
            (("fwd", forward, flops), ("fwd_bwd", gradient, 3.5 * flops))
        ):
            first, median, outputs[i] = _time(lambda fn=fn: fn(*qkv), shapes)
            row |= {
                f"{name}_ms": median * 1e3,
                f"{name}_tflops": count / median / 1e12,
                f"{name}_first_call_s": first,
            }
    except Exception as err:  # a failing impl is a result, not the end of the section
        row["error"] = short_error(err)
    return row, outputs


def _inputs(seq: int, shapes: AttentionShapes) -> tuple:
    """Fresh random q, k, v ``(tokens // seq, seq, heads, head_dim)``, seeded by ``seq``."""
    import jax

    batch = max(1, shapes.tokens // seq)
    keys = jax.random.split(jax.random.key(seq), 3)
    shape = (batch, seq, shapes.heads, shapes.head_dim)
    return tuple(jax.random.normal(key, shape, shapes.dtype) for key in keys)


def _check(rows: list[dict], outputs: list, dtype: str) -> None:
    """Compare each impl's output and gradients with the next impl's (cyclically: with two
    impls, each against the other), in place: each row gets ``fwd_rel_err`` /
    ``grad_rel_err``, ``check_against`` and ``check`` ("pass", "FAIL", or "n/a" where a
    side has no output: out of memory or an error)."""
    tol = TOLERANCE[dtype]
    for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
        j = (i + 1) % len(rows)
        other = outputs[j]
        errs = {}
        for k, name in enumerate(("fwd", "grad")):
            ok = out[k] is not None and other[k] is not None
            errs[name] = relative_error(out[k], other[k]) if ok else None
        row["fwd_rel_err"], row["grad_rel_err"] = errs["fwd"], errs["grad"]
        row["check_against"] = rows[j]["impl"]
        if None in errs.values():
            row["check"] = "n/a"
        else:
            row["check"] = "pass" if all(errs[n] <= tol[n] for n in errs) else "FAIL"


def _next_need(rows: list[dict], seconds: float) -> float:
    """The next (doubled) sequence length's likely seconds, from this one's ``seconds``:
    the first calls (compiles, about constant) again, the timed calls (work grows with
    the length at a fixed token count) twice over."""
    first = sum(r.get(f"{k}_first_call_s", 0.0) for r in rows for k in ("fwd", "fwd_bwd"))
    first = first if first == first else seconds  # NaN (out of memory): assume all of it
    return first + 2.0 * max(0.0, seconds - first)


def _headline(rows: list[dict]) -> str:
    """Each impl's best forward+backward TFLOP/s (and where), and the checks passed."""
    best: dict[str, tuple[float, int]] = {}
    for row in rows:
        value = row.get("fwd_bwd_tflops", float("nan"))
        if value == value and value > best.get(row["impl"], (0.0, 0))[0]:
            best[row["impl"]] = (value, row["seq"])
    checks = sum(row["check"] == "pass" for row in rows)
    cells = [f"{impl} f+b {v:.4g} TF/s @{s}" for impl, (v, s) in best.items()]
    return ", ".join([*cells, f"checks {checks}/{len(rows)} pass"])


def run_attention(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 3: every impl at every sequence length, checked against each other; a
    length is skipped when its likely time (``_next_need``) does not fit what is left."""
    from benchmarks.attention import _flops

    shapes = DRY if dry else GPU
    sink.set(
        **dataclasses.asdict(shapes),
        causal=True,
        tolerance=TOLERANCE[shapes.dtype],
        flops="fwd 4*b*h*s*s*d/2 (causal), fwd+bwd 3.5x fwd",
    )
    need = 0.0
    for seq in shapes.seqs:
        if not deadline.allows(need):
            sink.set(
                skipped=[skip_note(f"seq {s}", need, deadline) for s in shapes.seqs if s >= seq]
            )
            break
        start = time.perf_counter()
        qkv = _inputs(seq, shapes)
        batch = qkv[0].shape[0]
        flops = _flops(batch, shapes.heads, seq, shapes.head_dim, causal=True)
        cells = [_cell(impl, qkv, flops, shapes) for impl in shapes.impls]
        rows = [{"seq": seq, "batch": batch, **row} for row, _ in cells]
        _check(rows, [outputs for _, outputs in cells], shapes.dtype)
        for row in rows:
            sink.row(row)
        sink.set(headline=_headline(sink.rows))
        del qkv, cells
        need = _next_need(rows, time.perf_counter() - start)
