"""Speculative decoding in the serving engine (issue 47): prompt-lookup drafts verified in
the decode call.

    engine = Engine(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))

With ``speculative`` set, each step drafts up to ``k`` tokens for every decoding request
that may speculate (``can_speculate``) from its own prompt and generated tokens
(``propose_ngram_host``: the rule of ``edl.generate.ngram.propose_ngram``, in numpy on the
host, where the engine keeps each request's tokens; a test holds the two equal). When some
row has a draft, that step's decode call has width ``k + 1``: each row runs ``[pending,
drafts...]`` (``num_new`` = 1 + its drafts; 1 for a row without any) through
``model_step(..., every=True)``, which returns the logits at every position, and
``verify_step`` judges the drafts with ``edl.generate.verify``: greedy rows accept the
longest prefix equal to the argmax of their processed logits, sampled rows follow the
rejection rule (prompt-lookup drafts are a point mass ``q``) with their own settings
(``edl.ops.sampling.process_rows``: logit bias, temperature, top-k / top-p / min-p) and the
key ``fold_in(key(seed), tokens generated so far)``, so a seed reproduces its tokens. A row
emits ``accepted + 1`` tokens (fewer at a stop token or ``max_tokens``), and the engine sets
its ``computed`` back past the rejected positions, which later writes overwrite. A step
where no row drafted is the plain width-1 decode call.

Rows that do not speculate (they decode one token in the same call, through the engine's
``Sampler`` on the first position's logits): requests with a repetition / presence /
frequency penalty (their penalty state would need updating between verified positions),
with a grammar (its matcher would need to check each draft), or asking for ``logprobs``;
and a request one token from its ``max_tokens``. A sampled row that found no draft in a
step also takes the ``Sampler``'s token, so its draws depend on its own history alone.

Back-off: a request whose drafts were all rejected drafts nothing for its next 1, 2, 4,
... steps (``MAX_PAUSE`` at most; again at once after an accepted draft). A decode call
that verifies costs about ``k + 1`` tokens per row on CPU (2.8x a one-token call at 8 rows,
``benchmarks/RESULTS.md``), paid by every row of the call once one row drafts, so text that
does not repeat must not keep the whole batch at that width. The pause depends on the
request's own verdicts only: a seed still gives the same tokens whatever else runs.

Pages: a row drafts at most ``max_tokens - generated - 1`` tokens, so a verification
writes inside the pages the request reserved (prompt + ``max_tokens``).

A draft model (``SpeculativeConfig(method="draft")``, ``Engine(..., draft_model=)``):
``edl.serve.draft.DraftRunner`` runs it beside the target on its own page pools (the same
page table), through every prefill chunk, and proposes each speculating request's drafts
with its most likely tokens; it drafts for every request that may speculate (no back-off:
its cache has to keep up with the request's tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from edl.generate.proposers import PROPOSERS
from edl.generate.speculative import SpeculativeConfig, check_draft_model
from edl.generate.verify import emitted_tokens, greedy_verify, rejection_verify
from edl.ops.sampling import RowSampling, process_rows
from edl.serve.draft import DraftRunner
from edl.serve.requests import Request
from edl.serve.sampler import row_settings
from edl.serve.types import SamplingParams

__all__ = ["MAX_PAUSE", "Speculation", "can_speculate", "propose_ngram_host", "verify_step"]

MAX_PAUSE = 16
"""Steps a request drafts nothing, at most, after its drafts were all rejected (module
docstring: back-off)."""


def propose_ngram_host(
    tokens: Sequence[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int
) -> np.ndarray:
    """Prompt lookup for one sequence, on the host: ``edl.generate.ngram.propose_ngram``'s
    rule (the longest ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens occur earlier,
    its earliest occurrence; the tokens after it, up to ``num_tokens``, that exist). Returns
    the drafts ``(m,)``, ``m <= num_tokens`` (empty: no match). One pass over the sequence
    (where the last token occurs before), then only those places: a step's lookup costs
    microseconds, not a model call's fraction."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"propose_ngram_host: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    seq = np.asarray(tokens)
    length = len(seq)
    if length < 2:
        return seq[:0]
    # Where an earlier n-gram could end: the last token occurs there, and a token follows.
    ends = np.flatnonzero(seq[: length - 1] == seq[length - 1])
    for n in range(max_n, min_n - 1, -1):  # longest first
        found = ends[ends >= n - 1]
        for j in range(1, n):
            found = found[seq[found - j] == seq[length - 1 - j]]
        if found.size:  # the earliest occurrence
            start = int(found[0]) + 1
            return seq[start : start + num_tokens]
    return seq[:0]


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's tokens may be drafted and verified (module docstring)."""
    return params.logprobs is None and params.grammar is None and not params.has_penalty


@jax.jit
def verify_step(
    logits: Float[Array, "batch k1 vocab"],
    sampling: RowSampling,
    drafts: Int[Array, "batch k"],
    valid: Bool[Array, "batch k"],
) -> tuple[Int[Array, " batch"], Int[Array, "batch k1"], Float[Array, "batch k1"]]:
    """Each row's verdict on its drafts: ``(accepted, emitted, logprobs)``.

    ``logits``: the target's raw float32 logits at the pending token and each draft;
    ``sampling``: the rows' settings (penalties off; ``counter``: tokens generated before
    this call). ``emitted``: the accepted drafts, then the target's token (``accepted + 1``
    real tokens, then 0); ``logprobs``: each emitted token's log-prob under the raw logits
    (as ``sample_rows`` reports it)."""
    rows, k1, vocab = logits.shape
    per_position = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), sampling)
    scores = process_rows(logits.reshape(rows * k1, vocab), per_position)
    scores = scores.reshape(rows, k1, vocab)
    accepted, token = greedy_verify(scores, drafts, valid)

    def sampled() -> tuple[Array, Array]:
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(
            sampling.seed, sampling.counter
        )

        def one(p, d, v, key):  # a row of its own: its key alone decides its draws
            a, t = rejection_verify(p[None], None, d[None], v[None], key)
            return a[0], t[0]

        return jax.vmap(one)(jax.nn.softmax(scores, axis=-1), drafts, valid, keys)

    # The draws cost a softmax and Gumbel noise over every position: only when a row samples.
    hot = sampling.temperature > 0
    drawn = jax.lax.cond(jnp.any(hot), sampled, lambda: (accepted, token))
    accepted, token = jnp.where(hot, drawn[0], accepted), jnp.where(hot, drawn[1], token)
    emitted = emitted_tokens(drafts, accepted, token, 0)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return accepted, emitted, jnp.take_along_axis(logprobs, emitted[..., None], axis=2)[..., 0]


def _history(request: Request) -> np.ndarray:
    """The request's prompt and generated tokens as one array, kept on the request and
    extended by the tokens generated since the last call (not rebuilt every step)."""
    size = len(request.prompt) + request.params.max_tokens
    if request.history is None:
        request.history = np.zeros(size, np.int32)
        request.history[: len(request.prompt)] = request.prompt
        request.history_len = len(request.prompt)
    total = len(request.prompt) + len(request.generated)
    done = request.history_len - len(request.prompt)
    request.history[request.history_len : total] = request.generated[done:]
    request.history_len = total
    return request.history[:total]


class Speculation:
    """The engine's speculative decoding: its settings, each step's drafts and verdicts,
    and the counts ``/metrics`` reports (``drafted`` tokens, ``accepted`` ones)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model: Any,
        draft_model: Any = None,
        geometry: Mapping[str, Any] | None = None,
    ) -> None:
        """``geometry``: the engine's page pool and call shapes, which a draft model's
        ``DraftRunner`` shares (``num_pages``, ``page_size``, ``max_model_len``,
        ``row_buckets``, ``page_buckets``)."""
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"Engine: speculative must be a SpeculativeConfig, got {config!r}")
        needs = PROPOSERS[config.method].needs_model
        if needs and draft_model is None:
            raise ValueError(f"Engine: speculative method {config.method!r} needs draft_model=")
        if not needs and draft_model is not None:
            raise ValueError(f"Engine: speculative method {config.method!r} takes no draft_model")
        self.runner = None
        if needs:
            check_draft_model(model, draft_model)
            if geometry is None:
                raise ValueError("Speculation: a draft model needs the engine's geometry")
            self.runner = DraftRunner(draft_model, **geometry)
        self.config, self.k = config, config.num_speculative_tokens
        self.drafted = self.accepted = 0

    def drafts(self, requests: Sequence[Request]) -> list[np.ndarray] | None:
        """Each decoding request's drafts (empty where it does not speculate, pauses or
        found none), at most its room (``max_tokens - generated - 1``); None when no row
        drafted (the step's decode call is then the plain one). A draft model drafts for
        every request that may speculate, without pauses (its cache must keep up)."""
        rooms = [min(self.k, r.params.max_tokens - len(r.generated) - 1) for r in requests]
        if self.runner is None:
            out = [self._lookup(r, room) for r, room in zip(requests, rooms, strict=True)]
        else:
            out = [np.zeros(0, np.int32) for _ in requests]
            chosen = [i for i, r in enumerate(requests) if rooms[i] > 0 and can_speculate(r.params)]
            if chosen:
                drafted = self.runner.propose(
                    [requests[i] for i in chosen], [rooms[i] for i in chosen]
                )
                for i, d in zip(chosen, drafted, strict=True):
                    out[i] = d
        return out if any(len(d) for d in out) else None

    def _lookup(self, request: Request, room: int) -> np.ndarray:
        """Prompt lookup's drafts for one request (none while it pauses: the back-off)."""
        request.draft_pause -= 1
        if room <= 0 or request.draft_pause >= 0 or not can_speculate(request.params):
            return np.zeros(0, np.int32)
        c = self.config
        return propose_ngram_host(_history(request), room, c.prompt_lookup_min, c.prompt_lookup_max)

    def verify(
        self,
        logits: Float[Array, "rows k1 vocab"],
        requests: Sequence[Request],
        drafts: Sequence[np.ndarray],
    ) -> list[tuple[list[int], list[float], int] | None]:
        """Per request: ``(tokens, logprobs, accepted)`` where it drafted (the emitted
        tokens, their log-probs, how many drafts were accepted), else None (its token is
        the ``Sampler``'s). Counts the drafted and accepted tokens."""
        rows = logits.shape[0]
        sampling = row_settings(rows, [(r.params, r.seed, len(r.generated)) for r in requests])
        tokens, valid = np.zeros((rows, self.k), np.int32), np.zeros((rows, self.k), bool)
        for i, d in enumerate(drafts):
            tokens[i, : len(d)], valid[i, : len(d)] = d, True
        accepted, emitted, logprobs = map(np.asarray, verify_step(logits, sampling, tokens, valid))
        out: list[tuple[list[int], list[float], int] | None] = []
        for i, d in enumerate(drafts):
            if not len(d):
                out.append(None)
                continue
            a = int(accepted[i])
            self.drafted, self.accepted = self.drafted + len(d), self.accepted + a
            r = requests[i]
            if self.runner is not None:  # the draft cache keeps the pending token, a drafts
                r.draft_computed = r.computed + 1 + min(a, len(d) - 1)
            else:
                r.draft_misses = 0 if a else r.draft_misses + 1
                r.draft_pause = min(2 ** (r.draft_misses - 1), MAX_PAUSE) if not a else 0
            out.append((emitted[i, : a + 1].tolist(), logprobs[i, : a + 1].tolist(), a))
        return out

    def warmup(
        self,
        row_buckets: Sequence[int],
        vocab: int,
        step_shapes: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Compile ``verify_step`` for every row bucket (nothing drafted: no state changes)
        and, with a draft model, its calls: the engine's ``step_shapes`` but verification,
        and the two-token catch-up of each decode shape."""
        if self.runner is not None:
            shapes = [s for s in step_shapes if s[1] != self.k + 1]
            shapes += [(rows, 2, pages) for rows, width, pages in step_shapes if width == 1]
            self.runner.warmup(shapes)
        for rows in row_buckets:
            logits = jnp.zeros((rows, self.k + 1, vocab), jnp.float32)
            tokens = np.zeros((rows, self.k), np.int32)
            verify_step(logits, row_settings(rows, []), tokens, tokens.astype(bool))
