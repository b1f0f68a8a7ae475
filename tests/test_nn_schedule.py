"""edl.nn.schedule, the pure-Python half of run_stack: the plan covers every layer exactly
once, in order, each with its own group, position in its group's stack and setting; a
repeating schedule is one segment (one scan) plus runs for its tail."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl.nn.schedule import ScheduledLayer, Segment, plan_schedule, schedule_period

# Short alphabets make repeats and runs common.
schedules = st.lists(
    st.tuples(st.sampled_from(["layers", "dense_layers"]), st.sampled_from([None, 4096])),
    max_size=24,
)


def _expected(schedule):
    seen = {}
    for i, (group, setting) in enumerate(schedule):
        yield ScheduledLayer(i, group, seen.get(group, 0), setting)
        seen[group] = seen.get(group, 0) + 1


@given(schedules)
def test_segments_cover_every_layer_once_in_order(schedule):
    groups, settings = [g for g, _ in schedule], [s for _, s in schedule]
    segments = plan_schedule(groups, settings)
    assert [layer for seg in segments for layer in seg.layers()] == list(_expected(schedule))
    # Contiguous, non-empty, and each a block repeated.
    assert [seg.start for seg in segments] == [0, *(seg.stop for seg in segments)][:-1]
    for seg in segments:
        assert seg.repeats >= 1 and seg.block
        assert schedule[seg.start : seg.stop] == list(seg.block) * seg.repeats


@given(schedules)
def test_a_repeating_schedule_is_one_segment_then_runs(schedule):
    segments = plan_schedule([g for g, _ in schedule], [s for _, s in schedule])
    period = schedule_period(schedule)
    if period < len(schedule):
        first, *tail = segments
        assert (first.start, len(first.block)) == (0, period)
        assert first.repeats == len(schedule) // period
    else:
        tail = segments
    for seg in tail:  # runs of equal layers, each as long as it can be
        assert len(seg.block) == 1
    for a, b in itertools.pairwise(tail):
        assert a.block != b.block


@pytest.mark.parametrize(
    ("groups", "settings", "expected"),
    [
        # Gemma 2: alternating windows, one scan over pairs, a tail layer.
        (
            "aaaaa",
            (8, None) * 2 + (8,),
            [
                Segment(0, 2, (("a", 8), ("a", None)), {"a": 0}),
                Segment(4, 1, (("a", 8),), {"a": 4}),
            ],
        ),
        # Uniform: one scan straight over the layers.
        ("aaa", (None,) * 3, [Segment(0, 3, (("a", None),), {"a": 0})]),
        # Qwen2: full layers, then sliding ones: two runs.
        (
            "aaaa",
            (None, None, 8, 8),
            [Segment(0, 2, (("a", None),), {"a": 0}), Segment(2, 2, (("a", 8),), {"a": 2})],
        ),
        # Qwen3-MoE: dense layers among MoE ones, each group at its own offset.
        (
            "babab",
            (None,) * 5,
            [
                Segment(0, 2, (("b", None), ("a", None)), {"b": 0, "a": 0}),
                Segment(4, 1, (("b", None),), {"b": 2}),
            ],
        ),
        ("", (), []),
    ],
)
def test_known_plans(groups, settings, expected):
    assert list(plan_schedule(list(groups), settings)) == expected


def test_segment_positions_within_groups():
    seg = Segment(3, 2, (("a", None), ("b", None), ("a", 1)), {"a": 2, "b": 1})
    assert seg.stop == 9
    assert [seg.per_block(g) for g in "ab"] == [2, 1]
    assert [seg.in_block(k) for k in range(3)] == [0, 0, 1]
    assert [(x.index, x.group, x.local) for x in seg.layers()] == [
        (3, "a", 2),
        (4, "b", 1),
        (5, "a", 3),
        (6, "a", 4),
        (7, "b", 2),
        (8, "a", 5),
    ]


def test_mismatched_settings_are_named():
    with pytest.raises(ValueError, match="3 settings for 2 layers"):
        plan_schedule(["a", "a"], [None] * 3)
