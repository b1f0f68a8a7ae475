"""The engine's step shapes as sizes and names: the buckets that fix the set of compiled
shapes (``edl.serve.engine``'s docstring), the ``Engine``'s size checks, and the names the
progress lines give a shape. Plain Python, no jax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from edl.serve.types import is_int

__all__ = [
    "bucket",
    "buckets",
    "check_sizes",
    "prefill_batch",
    "shape_name",
    "step_shapes",
    "warmup_progress",
]

T = TypeVar("T")
Shape = tuple[int, int, int]


def buckets(top: int, smallest: int, factor: int) -> tuple[int, ...]:
    """``smallest * factor ** i`` below ``top``, then ``top``."""
    sizes, size = [], smallest
    while size < top:
        sizes.append(size)
        size *= factor
    return (*sizes, top)


def bucket(buckets: tuple[int, ...], size: int) -> int:
    """The smallest bucket holding ``size``."""
    return next(b for b in buckets if b >= size)


def step_shapes(
    row_buckets: tuple[int, ...],
    width_buckets: tuple[int, ...],
    page_buckets: tuple[int, ...],
    prefill_tokens: int,
    k: int = 0,
) -> tuple[list[Shape], list[Shape], list[Shape]]:
    """An engine's ``(rows, width, pages)`` step shapes, apart: decode (width 1),
    speculative verification (width ``k + 1``; none when ``k`` is 0) and prefill (``rows *
    width <= prefill_tokens``). A verification shape may equal a prefill one; their
    programs differ (``model_step``'s ``every`` variant)."""
    decode = [(rows, 1) for rows in row_buckets]
    verify = [(rows, k + 1) for rows in row_buckets] if k else []
    prefill = [
        (rows, width)
        for width in width_buckets
        for rows in row_buckets
        if rows * width <= prefill_tokens
    ]
    return tuple(  # type: ignore[return-value]
        [(r, w, p) for r, w in kind for p in page_buckets] for kind in (decode, verify, prefill)
    )


def prefill_batch(
    chunks: Sequence[tuple[T, int]],
    row_buckets: tuple[int, ...],
    width_buckets: tuple[int, ...],
    prefill_tokens: int,
) -> tuple[list[T], int, int]:
    """The longest leading run of ``chunks`` (``(request, its chunk's tokens)``, oldest
    first) whose padded call fits ``prefill_tokens``, and that call's ``(rows, width)`` (the
    first always fits when ``prefill_tokens`` holds a whole chunk)."""
    chosen: list[T] = []
    rows = width = 0
    for request, chunk in chunks:
        w = bucket(width_buckets, max(width, chunk))
        n = bucket(row_buckets, len(chosen) + 1)
        if n * w > prefill_tokens:
            break
        chosen.append(request)
        rows, width = n, w
    return chosen, rows, width


def shape_name(shape: tuple[int, ...]) -> str:
    """A step shape ``(rows, width, pages)`` or program ``(rows, width, pages, logprobs,
    verify)`` as the progress lines name it: ``decode 8x1, 4 pages``, ``prefill 2x64, 16
    pages, log-probs`` or (a speculative decode call) ``verify 4x5, 8 pages``."""
    rows, width, pages = shape[:3]
    logprobs, verify = (*shape[3:], False, False)[:2]
    kind = "verify" if verify else "decode" if width == 1 else "prefill"
    return f"{kind} {rows}x{width}, {pages} pages{', log-probs' if logprobs else ''}"


def warmup_progress(
    shape: tuple[int, ...],
    done: int,
    total: int,
    seconds: float,
    elapsed: float,
    cached: bool = False,
) -> str:
    """One line of ``Engine.warmup``'s progress: the shape just compiled (the ``done``-th
    of ``total``; ``cached``: loaded from jax's persistent cache) and its ``seconds``, the
    ``elapsed`` seconds so far and the time left at the mean pace so far."""
    left = elapsed / done * (total - done)
    return (
        f"{'loaded' if cached else 'compiled'} {shape_name(shape)} ({done}/{total}): "
        f"{seconds:.1f} s; {elapsed:.0f} s so far, about {left:.0f} s left"
    )


def check_sizes(**sizes: object) -> None:
    """``Engine``'s sizes are integers >= 1, and a prefill call holds at least one chunk;
    ``ValueError`` naming the offending ones."""
    bad = {k: v for k, v in sizes.items() if not is_int(v) or v < 1}
    if bad:
        raise ValueError(f"Engine: these must be integers >= 1: {bad}")
    if sizes["prefill_tokens"] < sizes["prefill_chunk"]:
        raise ValueError(
            f"Engine: prefill_tokens ({sizes['prefill_tokens']}) must be at least "
            f"prefill_chunk ({sizes['prefill_chunk']})"
        )
