"""The engine's step shapes as sizes and names: the buckets that fix the set of compiled
shapes (``edl.serve.engine``'s docstring), the ``Engine``'s size checks, and the names the
progress lines give a shape. Plain Python, no jax."""

from __future__ import annotations

from edl.serve.types import is_int

__all__ = ["bucket", "buckets", "check_sizes", "shape_name", "warmup_progress"]


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


def shape_name(shape: tuple[int, ...]) -> str:
    """A step shape ``(rows, width, pages)`` or program ``(rows, width, pages, logprobs,
    masked)`` as the progress lines name it: ``decode 8x1, 4 pages`` or ``prefill 2x64, 16
    pages, log-probs, grammar``."""
    rows, width, pages = shape[:3]
    flags = ("log-probs", "grammar")
    tail = "".join(f", {name}" for name, on in zip(flags, shape[3:], strict=False) if on)
    return f"{'decode' if width == 1 else 'prefill'} {rows}x{width}, {pages} pages{tail}"


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
