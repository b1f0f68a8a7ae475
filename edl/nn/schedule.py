"""Planning a run over stacked layers: which layers one ``lax.scan`` covers (pure Python).

A model's layers form a *schedule*: each layer has a *group* (the stack that holds its
weights: models with several kinds of layer keep one stack per kind, e.g. Qwen3-MoE's dense
layers among MoE layers) and a static *setting* (a sliding window). ``plan_schedule`` cuts
the schedule into ``Segment``s, each a block of layers repeated some number of times, so that
``edl.nn.stack.run_segments`` can run each segment as one scan over its blocks:

- a schedule with a repeating pattern (a uniform stack; Gemma 2's sliding / global
  alternation; an MoE layer every other layer) is one segment whose block is one period,
  then one segment per run of equal layers in any tail the pattern leaves;
- without one (Qwen2's full layers, then sliding ones), each run of equal layers is a
  segment whose block is one layer.

Nothing here touches arrays, so the plan is testable (and readable) on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["ScheduledLayer", "Segment", "plan_schedule", "schedule_period"]


class ScheduledLayer(NamedTuple):
    """One layer of a schedule: its position in the model, its group, its position in that
    group's stack, and its static setting."""

    index: int
    group: str
    local: int
    setting: Any


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``start <= i < stop`` of a schedule as ``repeats`` copies of one ``block``.

    ``block`` lists the ``(group, setting)`` of each layer of one block; ``offsets[g]`` is
    the position, in group ``g``'s stack, of the segment's first layer of group ``g``. Run
    scanned, a segment is one ``lax.scan`` of ``repeats`` steps, each step running the
    block's layers in order."""

    start: int
    repeats: int
    block: tuple[tuple[str, Any], ...]
    offsets: Mapping[str, int]

    @property
    def stop(self) -> int:
        return self.start + self.repeats * len(self.block)

    def per_block(self, group: str) -> int:
        """How many layers of ``group`` one block holds."""
        return sum(g == group for g, _ in self.block)

    def in_block(self, k: int) -> int:
        """Block layer ``k``'s position among the block's layers of its own group."""
        return sum(g == self.block[k][0] for g, _ in self.block[:k])

    def layers(self) -> Iterator[ScheduledLayer]:
        """Every layer of the segment, in order."""
        for r in range(self.repeats):
            for k, (group, setting) in enumerate(self.block):
                local = self.offsets[group] + r * self.per_block(group) + self.in_block(k)
                yield ScheduledLayer(self.start + r * len(self.block) + k, group, local, setting)


def schedule_period(schedule: Sequence[Hashable]) -> int:
    """The smallest ``p <= len // 2`` with ``schedule[i] == schedule[i % p]`` for every ``i``
    (a repeating pattern, possibly cut short at the end), else ``len(schedule)``."""
    n = len(schedule)
    for p in range(1, n // 2 + 1):
        if all(schedule[i] == schedule[i % p] for i in range(n)):
            return p
    return n


def _runs(schedule: Sequence[Hashable], start: int, end: int) -> list[tuple[int, int]]:
    """``[a, b)`` spans of consecutive equal entries within ``[start, end)``."""
    spans, a = [], start
    for i in range(start + 1, end + 1):
        if i == end or schedule[i] != schedule[a]:
            spans.append((a, i))
            a = i
    return spans


def plan_schedule(groups: Sequence[str], settings: Sequence[Any]) -> tuple[Segment, ...]:
    """The segments that run layer ``i`` (group ``groups[i]``, setting ``settings[i]``),
    every layer once, in order: one segment over the blocks of a repeating pattern, if the
    schedule has one, then one per run of equal layers (the pattern's tail, or all layers).
    Settings are compared with ``==``."""
    if len(groups) != len(settings):
        raise ValueError(f"plan_schedule: {len(settings)} settings for {len(groups)} layers")
    schedule = list(zip(groups, settings, strict=True))
    n = len(schedule)

    def segment(start: int, repeats: int, block: Sequence[tuple[str, Any]]) -> Segment:
        offsets = {g: sum(x == g for x in groups[:start]) for g, _ in block}
        return Segment(start, repeats, tuple(block), offsets)

    period = schedule_period(schedule)
    segments = [segment(0, n // period, schedule[:period])] if period < n else []
    tail = segments[0].stop if segments else 0
    segments += [segment(a, b - a, [schedule[a]]) for a, b in _runs(schedule, tail, n)]
    return tuple(segments)
