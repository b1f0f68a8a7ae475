"""Multi-turn rollouts: the model talks to one environment per row
(``edl.train.environments``) for up to ``max_turns`` turns, batched over every row (the
prompts times their samples), rows finishing at different turns.

Each turn: every unfinished row's sequence so far is generated on (``edl.generate``, one
batch of the rows still going, compacted to the front and filled with repeats up to the
next power of two, :func:`turn_batch_size`) until
the end-of-turn token (EOS) or the environment's ``stop`` text when that is one token
(``</tool_call>``); the turn is decoded and given to ``env.step``; its messages (tool
results, a user's reply) are rendered by the chat template and their tokens appended, then
the next turn. The model's
tokens are kept exactly as sampled (never decoded and re-tokenised); only the environment's
messages are tokenised, as the template renders them after an assistant turn (TRL 1.16's
``_get_tool_suffix_ids``: the template on a short stand-in conversation with and without
the messages, cut after the stand-in's last EOS; a template whose earlier text changes
when messages follow is refused, naming the messages).

A row ends when the environment says ``done`` or answers with no message, at ``max_turns``
(the last turn is still stepped, for its reward, but its answer is not appended: no model
turn follows), or when a turn reaches the token budget without a stop token (``truncated``:
there is no complete turn to answer; the environment is not stepped).

:func:`trajectory_batch` lays the rows out for the GRPO / distillation updates: the
left-padded prompt, then everything after it (model and environment tokens, right-padded);
the loss mask is 1 exactly on the model's own tokens, so environment and template tokens
are context only, while the old-policy and reference log-probs come from forwards over the
whole sequence. Widths are ``prompt_bucket``-rounded, so steps reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from edl.generate import generate
from edl.generate.decode import prompt_bucket
from edl.train.environments import Environment

__all__ = [
    "Trajectory",
    "multi_turn_rollout",
    "template_suffix",
    "trajectory_batch",
    "turn_batch_size",
]


@dataclasses.dataclass
class Trajectory:
    """One row's conversation: ``prompt`` ids, then ``tokens`` (every token after the
    prompt) with ``own[i]`` True where the model sampled ``tokens[i]``; the summed
    environment ``reward``; ``turns`` generated; ``truncated`` when a turn hit the token
    budget; ``messages``: the environment's opening messages, then each turn (the
    assistant's decoded text) and the environment's answers; ``answer``: the last turn's
    text."""

    prompt: list[int]
    env: Environment
    tokens: list[int] = dataclasses.field(default_factory=list)
    own: list[bool] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    answer: str = ""

    @property
    def tool_calls(self) -> int:
        """The tool results the environment answered with (one ``tool`` message per call)."""
        return sum(m.get("role") == "tool" for m in self.messages)

    def extend(self, ids: Sequence[int], own: bool) -> None:
        self.tokens += list(ids)
        self.own += [own] * len(ids)


def template_suffix(tokenizer: Any, messages: list[dict[str, Any]], eos_id: int) -> list[int]:
    """The tokens the chat template puts after an assistant turn's EOS for ``messages``
    (and the next assistant header): rendered on a stand-in conversation (user, then an
    assistant turn, calling the first tool message's tool when there is one) with and
    without ``messages``, as TRL's ``_get_tool_suffix_ids``."""
    assistant: dict[str, Any] = {"role": "assistant", "content": ""}
    tool = next((m for m in messages if m.get("role") == "tool"), None)
    if tool is not None:
        name = tool.get("name") or "tool"
        assistant["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": {}}}
        ]
    stand_in = [{"role": "user", "content": "x"}, assistant]
    before = tokenizer.apply_chat_template(stand_in, add_generation_prompt=False)
    after = tokenizer.apply_chat_template(stand_in + list(messages), add_generation_prompt=True)
    ends = [i for i, t in enumerate(before) if t == eos_id]
    before = before[: ends[-1] + 1] if ends else before
    if after[: len(before)] != before:
        raise ValueError(
            "multi-turn rollout: the chat template renders an assistant turn differently when "
            f"messages follow it, so the environment's messages {messages!r:.200} cannot be "
            "appended as tokens; use a prefix-preserving template"
        )
    return after[len(before) :]


def _stop_ids(tokenizer: Any, env: Environment, eos_id: int) -> tuple[int, ...]:
    stop = getattr(env, "stop", None)
    ids = list(tokenizer.encode(stop)) if stop else []
    return (eos_id, ids[0]) if len(ids) == 1 and ids[0] != eos_id else (eos_id,)


def turn_batch_size(active: int, rows: int) -> int:
    """The batch a turn generates with ``active`` of ``rows`` rows still going: the next
    power of two, at most ``rows``. Finished rows are not decoded again, while a rollout of
    ``rows`` compiles at most ``log2(rows) + 1`` batch sizes per width bucket (one per
    count of rows still going cost more compiling than the repeats' decoding saved). The
    tokens are those of a full batch: the active rows keep their places at the front, and
    ``jax.random.categorical`` draws row ``i``'s noise from its own counters (threefry's
    partitionable layout, jax's default), so a shorter batch gives its rows the same
    draws."""
    if not 1 <= active <= rows:
        raise ValueError(f"turn_batch_size: need 1 <= active <= rows, got {active}, {rows}")
    return min(rows, 1 << (active - 1).bit_length())


def _generate_turn(
    model: Any, rows: list[Trajectory], key: PRNGKeyArray, sampling: Mapping[str, Any], size: int
) -> list[list[int]]:
    """One turn's tokens for each of ``rows`` (stop token included), generated as one batch
    of ``size`` rows (repeats of the first fill it; their tokens are discarded)."""
    contexts = [r.prompt + r.tokens for r in rows]
    contexts += [contexts[0]] * (size - len(rows))
    width = max(len(c) for c in contexts)
    ids = np.full((size, width), sampling["pad_token_id"], np.int32)
    mask = np.zeros((size, width), bool)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :], mask[i, width - len(c) :] = c, True
    out = generate(model, ids, attention_mask=mask, key=key, do_sample=True, **sampling)
    new, num_new = np.asarray(out.sequences[:, width:]), np.asarray(out.num_new)
    return [new[i, : num_new[i]].tolist() for i in range(len(rows))]


def _step_row(
    row: Trajectory, turn: list[int], tokenizer: Any, stops: tuple[int, ...], last: bool
) -> None:
    """Give ``turn`` (sampled tokens) to the row's environment and append its answer (not
    after the ``last`` turn: no model turn would follow it)."""
    eos = stops[0]
    row.extend(turn, own=True)
    row.turns += 1
    stopped = bool(turn) and turn[-1] in stops
    text = tokenizer.decode(turn[:-1] if stopped and turn[-1] == eos else turn)
    row.answer = text
    row.messages.append({"role": "assistant", "content": text})
    if not stopped:  # the budget ended the turn: nothing complete to answer
        row.done = row.truncated = True
        return
    messages, reward, done = row.env.step({"role": "assistant", "content": text})
    row.reward += float(reward)
    row.messages += list(messages)
    row.done = bool(done) or not messages or last
    if not row.done:
        # A turn cut at the call's closing tag still needs its end of turn: template text.
        closing = [] if turn[-1] == eos else [eos]
        row.extend(closing + template_suffix(tokenizer, list(messages), eos), own=False)


def multi_turn_rollout(
    model: Any,
    tokenizer: Any,
    envs: Sequence[Environment],
    records: Sequence[Mapping[str, Any]],
    *,
    key: PRNGKeyArray,
    max_turns: int,
    eos_id: int,
    sampling: Mapping[str, Any],
) -> list[Trajectory]:
    """Roll out ``envs[i]`` from ``records[i]`` with ``model`` (module docstring).

    ``sampling``: ``generate``'s keyword arguments per turn (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``, ``pad_token_id``); turn ``t`` samples with
    ``fold_in(key, t)``. Every environment must share one stop text (the turn's stop ids).
    """
    if max_turns < 1:
        raise ValueError(f"multi_turn_rollout: max_turns must be >= 1, got {max_turns}")
    rows = []
    for env, record in zip(envs, records, strict=True):
        opening = env.reset(record)
        tools = getattr(env, "tools", None) or None
        ids = tokenizer.apply_chat_template(opening, add_generation_prompt=True, tools=tools)
        rows.append(Trajectory(list(ids), env, messages=list(opening)))
    stops = _stop_ids(tokenizer, envs[0], eos_id)
    sampling = {**sampling, "eos_token_id": stops, "top_k": sampling.get("top_k")}
    for turn in range(max_turns):
        active = [r for r in rows if not r.done]
        if not active:
            break
        size = turn_batch_size(len(active), len(rows))
        turns = _generate_turn(model, active, jax.random.fold_in(key, turn), sampling, size)
        for row, tokens in zip(active, turns, strict=True):
            _step_row(row, tokens, tokenizer, stops, last=turn == max_turns - 1)
    return rows


def trajectory_batch(rows: Sequence[Trajectory], pad_id: int) -> dict[str, Array]:
    """The update's batch: ``input_ids`` / ``attention_mask`` ``(rows, P + C)`` (the prompt
    left-padded to ``P``, the rest right-padded to ``C``, both ``prompt_bucket``-rounded),
    ``completion_mask`` ``(rows, C)`` float32: 1 on the model's own tokens only."""
    width_p = prompt_bucket(max(len(r.prompt) for r in rows))
    width_c = prompt_bucket(max(1, *(len(r.tokens) for r in rows)))
    ids = np.full((len(rows), width_p + width_c), pad_id, np.int32)
    mask = np.zeros(ids.shape, bool)
    own = np.zeros((len(rows), width_c), np.float32)
    for i, r in enumerate(rows):
        ids[i, width_p - len(r.prompt) : width_p] = r.prompt
        mask[i, width_p - len(r.prompt) : width_p] = True
        ids[i, width_p : width_p + len(r.tokens)] = r.tokens
        mask[i, width_p : width_p + len(r.tokens)] = True
        own[i, : len(r.own)] = r.own
    return {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "completion_mask": jnp.asarray(own),
    }
