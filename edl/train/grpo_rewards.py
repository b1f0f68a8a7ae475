"""GRPO's rewards: the weighted sum of the reward functions' rewards, every value checked on
the host before it reaches the advantages (:func:`score_completions`, run by each GRPO step
on its decoded rollouts)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["RewardFn", "score_completions"]

RewardFn = Callable[..., Sequence[float | None] | np.ndarray | jax.Array]
"""``reward_fn(prompts, completions, completion_ids, **columns) -> rewards``: one reward per
completion. ``prompts[i]`` is completion ``i``'s prompt as given (a string, or chat messages;
each repeated ``num_generations`` times), ``completions[i]`` its decoded text (EOS and
padding removed), ``completion_ids[i]`` its token ids up to and including EOS. When the
prompts are records (``{"prompt": ..., "answer": ...}``), their other fields come as keyword
lists aligned with the completions (TRL passes dataset columns the same way), so a reward can
check against a reference answer.

Rewards are real numbers (``int``, ``float``, numpy real scalars, or a numpy / jax array of a
real dtype), finite in float32 and so is their weighted sum; ``bool`` counts as 0 / 1, as TRL
reads it (a pass / fail check is a natural reward). As in TRL, None means the function does not
apply to that completion (it adds no term to the sum), but each completion needs a reward from
at least one function. Strings (even ``"1.0"``), complex numbers and other objects are refused:
:func:`score_completions` raises a ``ValueError`` naming the function, row and value."""


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


_REAL_KINDS = "biuf"  # numpy's bool, signed, unsigned and floating dtypes: real numbers
_F32_MAX = float(np.finfo(np.float32).max)  # rewards and their weighted sum become float32


def _real(name: str, row: int, value: Any) -> float:
    """``value`` (one reward) as a float: a Python ``int``, ``float`` or ``bool``, a numpy
    real scalar or a 0-d array of a real dtype; anything else is a ValueError naming the
    function ``name``, the row and the value."""
    if isinstance(value, int | float):  # bool too (an int): True is 1, as in TRL
        try:
            return float(value)
        except OverflowError:  # an int beyond float64: out of range, refused by the caller
            return math.inf if value > 0 else -math.inf
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:  # objects numpy cannot read (a GPU tensor, ...)
        raise ValueError(
            f"reward function {name!r} returned a non-number at row {row}: {value!r:.80} "
            f"({type(value).__name__}): {e}"
        ) from e
    if array.ndim != 0 or array.dtype.kind not in _REAL_KINDS:
        raise ValueError(
            f"reward function {name!r} returned a non-number at row {row}: {value!r:.80} "
            f"({type(value).__name__}); rewards are real numbers (int, float, bool, numpy "
            "real scalars) or None (the function does not apply)"
        )
    return float(array)


def _reward_values(name: str, values: Any, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """One reward function's ``(rows,)`` rewards as float64 (0 where it returned None) and
    the mask of rows it returned a number for; a ValueError names the function and the
    first bad row and value: a non-number, or a number not finite in float32."""
    if isinstance(values, np.ndarray | jax.Array) and values.dtype.kind in _REAL_KINDS:
        rewards = np.asarray(values, np.float64)
        given = np.ones(rewards.shape, bool)
    elif isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise ValueError(
            f"reward function {name!r} returned {values!r:.80} ({type(values).__name__}), "
            "not a sequence of rewards"
        )
    else:
        items = list(values)
        given = np.array([v is not None for v in items], bool)
        reals = [0.0 if v is None else _real(name, row, v) for row, v in enumerate(items)]
        rewards = np.array(reals, np.float64)
    if rewards.shape != (rows,):
        raise ValueError(
            f"reward function {name!r} returned shape {rewards.shape}, expected one "
            f"reward per completion: ({rows},)"
        )
    bad = np.flatnonzero(given & ~(np.abs(rewards) <= _F32_MAX))  # NaN compares False
    if bad.size:
        raise ValueError(
            f"reward function {name!r} returned non-finite rewards at rows {bad[:8].tolist()}: "
            f"{rewards[bad[:8]].tolist()} (rewards must be finite in float32: "
            f"|r| <= {_F32_MAX:.8g})"
        )
    return rewards, given


def _check_total(total: np.ndarray, terms: list[tuple[str, float, np.ndarray, np.ndarray]]) -> None:
    """A ValueError unless every row has a reward from some function and the weighted sum
    ``total`` is finite in float32; ``terms``: (name, weight, rewards, given) per function."""
    row_terms = lambda row: ", ".join(
        f"{name!r}: {weight!r} * {float(rewards[row])!r}" if given[row] else f"{name!r}: None"
        for name, weight, rewards, given in terms
    )
    missing = np.flatnonzero(~np.any([given for *_, given in terms], axis=0))
    if missing.size:
        raise ValueError(
            f"no reward function applies to rows {missing[:8].tolist()} (each returned None: "
            f"{row_terms(missing[0])}); every completion needs a reward"
        )
    bad = np.flatnonzero(~(np.abs(total) <= _F32_MAX))
    if bad.size:
        raise ValueError(
            f"the weighted sum of the rewards leaves float32's range (|r| <= {_F32_MAX:.8g}) "
            f"at rows {bad[:8].tolist()}: {total[bad[:8]].tolist()}; row {bad[0]}: "
            f"{row_terms(bad[0])}"
        )


def score_completions(
    reward_fns: Sequence[RewardFn],
    weights: Sequence[float],
    prompts: list[Any],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]] | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """The weighted sum of every reward function's rewards ``(rows,)`` (float32) and each
    function's mean (``reward/<name>``, over the rows it applies to; left out when it
    applies to none); ``columns`` go to every function as keyword arguments.

    As in TRL, a reward of None means the function does not apply to that completion: it
    adds no term to the sum. Unlike TRL (which warns and gives such a row 0), a row that no
    function applies to is an error. Everything is checked here on the host, before any
    reward reaches the advantages: a ``ValueError`` names the function, row and value when
    a function returns the wrong number of rewards, a non-number (a string such as
    ``"1.0"``, a complex number, ...) or a reward not finite in float32 (NaN, inf,
    ``|r| > finfo(float32).max``), and names the rows and terms when the weighted sum
    leaves float32's range.
    """
    rows = len(completions)
    total, means, terms = np.zeros(rows, np.float64), {}, []
    for fn, weight in zip(reward_fns, weights, strict=True):
        name = _name(fn)
        values = fn(prompts, completions, completion_ids, **dict(columns or {}))
        rewards, given = _reward_values(name, values, rows)
        if given.any():
            means[f"reward/{name}"] = float(rewards[given].mean())
        total += weight * rewards  # 0 where the function does not apply
        terms.append((name, weight, rewards, given))
    _check_total(total, terms)
    return total.astype(np.float32), means
