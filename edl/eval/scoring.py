"""Teacher-forced scoring: each continuation token's log-probability under a causal LM and
whether greedy decoding would have produced it, for batches of padded requests.

Requests (``Request``: the model's input tokens and the number of continuation tokens at
their end) are sorted longest first, cut into batches of ``batch_size`` rows (the last one
filled with empty rows) and right-padded to a bucketed width (``edl.generate.decode
.prompt_bucket``: 16, 24, 32, 48, 64, ...), so a whole evaluation compiles one program per
width it meets. Right padding needs no mask: a causal model's positions never see what
follows them. No jax array outlives a batch, and the model is an argument of the compiled
program, not a constant in it: scoring a training run's live parameters copies nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from edl.generate.decode import prompt_bucket
from edl.generate.steps import CausalLM

__all__ = ["Request", "Score", "bucket_width", "score_requests", "token_scores"]

IGNORE = -1
"""The target of a position that is not scored (context and padding)."""

LOGITS_BUDGET = 1 << 26
"""float32 logits held at once (256 MiB): the LM head runs over chunks of positions of at
most this many ``rows * positions * vocab`` values, never the whole ``(batch, seq, vocab)``."""


@dataclasses.dataclass(frozen=True)
class Request:
    """``tokens``: the model's input followed by the continuation, already cut to the
    model's length (``max_length + 1`` tokens at most: the last is only a target);
    ``n_scored``: the continuation's length, the tokens scored at the end (>= 1)."""

    tokens: tuple[int, ...]
    n_scored: int

    def __post_init__(self) -> None:
        if not 1 <= self.n_scored < len(self.tokens):
            raise ValueError(
                f"Request: n_scored must be in [1, {len(self.tokens) - 1}] (the tokens but the "
                f"first), got {self.n_scored} for {len(self.tokens)} tokens"
            )


@dataclasses.dataclass(frozen=True)
class Score:
    """A request's summed float32 log-probability, whether every continuation token is the
    argmax of its position's logits, and each continuation token's log-probability."""

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...]


def bucket_width(length: int, max_length: int) -> int:
    """The padded width for inputs of ``length`` tokens: ``prompt_bucket(length)``, never
    beyond ``max_length`` (nor below ``length``)."""
    return max(length, min(prompt_bucket(length), max_length))


def _chunk(rows: int, seq: int, vocab: int) -> int:
    """Positions per LM-head chunk: the whole sequence when its logits fit the budget."""
    return max(1, min(seq, LOGITS_BUDGET // max(1, rows * vocab)))


@eqx.filter_jit
def token_scores(
    model: CausalLM, tokens: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """``(logps, greedy)``, both ``(batch, seq)``: ``logps[b, t] = log p(targets[b, t] |
    tokens[b, :t + 1])`` (log-softmax of the logits in float32, 0.0 where ``targets`` is
    ``IGNORE``) and whether ``targets[b, t]`` is that position's argmax (True where ignored).
    The LM head (``model.lm_logits``: LoRA, quantized and soft-capped heads as the model
    runs them) is applied to chunks of positions (``LOGITS_BUDGET``)."""
    hidden = model.model(tokens).last_hidden_state
    batch, seq, dim = hidden.shape
    chunk = _chunk(batch, seq, model.config.vocab_size)
    n = -(-seq // chunk)
    pad = n * chunk - seq
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(batch, n, chunk, dim)
    t = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=IGNORE).reshape(batch, n, chunk)

    def one(xs: tuple[Array, Array]) -> tuple[Array, Array]:
        h, t = xs  # (batch, chunk, dim), (batch, chunk)
        logits = model.lm_logits(h).astype(jnp.float32)
        scored = t != IGNORE
        safe = jnp.where(scored, t, 0)
        logp = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
        greedy = jnp.argmax(logits, axis=-1).astype(safe.dtype) == safe
        return jnp.where(scored, chosen, 0.0), greedy | ~scored

    logps, greedy = jax.lax.map(one, (jnp.moveaxis(h, 1, 0), jnp.moveaxis(t, 1, 0)))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, n * chunk)[:, :seq]
    return unchunk(logps), unchunk(greedy)


def batches(
    requests: Sequence[Request], batch_size: int, max_length: int
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """``(indices, tokens, targets)`` per batch, longest requests first: ``tokens`` and
    ``targets`` ``(batch_size, width)`` int32, the inputs right-padded with 0 and each
    request's continuation as targets (``IGNORE`` elsewhere); rows past ``indices`` are
    padding."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        width = bucket_width(len(requests[indices[0]].tokens) - 1, max_length)
        tokens = np.zeros((batch_size, width), np.int32)
        targets = np.full((batch_size, width), IGNORE, np.int32)
        for row, i in enumerate(indices):
            request = requests[i]
            n = len(request.tokens) - 1
            if n > width:
                raise ValueError(f"request {i}: {n} input tokens exceed max_length {max_length}")
            tokens[row, :n] = request.tokens[:-1]
            targets[row, n - request.n_scored : n] = request.tokens[n - request.n_scored + 1 :]
        yield indices, tokens, targets


def score_requests(
    model: CausalLM, requests: Sequence[Request], *, batch_size: int, max_length: int
) -> list[Score]:
    """Each request's :class:`Score`, in the order given (see :func:`batches`)."""
    scores: list[Score | None] = [None] * len(requests)
    for indices, tokens, targets in batches(requests, batch_size, max_length):
        logps, greedy = jax.device_get(token_scores(model, tokens, targets))
        for row, i in enumerate(indices):
            scored = targets[row] != IGNORE
            token_logps = logps[row][scored]
            scores[i] = Score(
                float(token_logps.sum(dtype=np.float32)),
                bool(greedy[row].all()),
                tuple(float(x) for x in token_logps),
            )
    return scores  # type: ignore[return-value]
