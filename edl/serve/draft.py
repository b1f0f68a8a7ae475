"""A draft model beside the serving engine's target, for speculative decoding
(``SpeculativeConfig(method="draft")``, ``edl.serve.speculation``).

The draft keeps its own key / value page pools, of its own geometry, indexed by the
target's page table: a request's pages hold its tokens in both pools, so prefix-shared
prompt pages are shared by both models and the draft needs no allocator of its own. The
draft runs every prefill chunk the target runs (``prefill``), and before each verification
proposes ``room`` tokens per speculating request (``propose``): one call feeding what its
cache lacks (the pending token, and after a verification that accepted every draft the
last draft too: one or two tokens, a width-2 call), then ``room - 1`` one-token calls,
each choosing the draft model's most likely token. The draft's choice is deterministic (a
point mass), which the rejection rule verifies exactly: sampled requests keep the target's
distribution, and only the acceptance rate depends on how well the draft model predicts.

Each call is ``edl.serve.step.model_step`` on the draft's pools (its shapes:
``(rows, 1 | 2 | prefill width, pages)``, from the engine's buckets; ``warmup`` compiles
them). A request's ``draft_computed`` counts the tokens in the draft's cache; after a
verification accepting ``a`` of ``room`` drafts it holds the tokens up to the pending one
and ``min(a, room - 1)`` drafts (``Speculation.verify``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edl.generate.decode import _without_id_checks
from edl.ops.sampling import greedy
from edl.serve.requests import Request, page_pools
from edl.serve.shapes import bucket
from edl.serve.step import model_step

__all__ = ["DraftRunner"]

_greedy = jax.jit(greedy)


class DraftRunner:
    """The draft model and its page pools (module docstring). ``num_pages``,
    ``page_size`` and ``max_model_len`` are the engine's; ``row_buckets`` /
    ``page_buckets`` its call shapes."""

    def __init__(
        self,
        model: Any,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        row_buckets: Sequence[int],
        page_buckets: Sequence[int],
    ) -> None:
        self.model = _without_id_checks(model).unstacked()
        self.k_pages, self.v_pages = page_pools(model, num_pages, page_size, max_model_len)
        self.page_size = page_size
        self.row_buckets, self.page_buckets = tuple(row_buckets), tuple(page_buckets)

    def _run(self, table, lengths, tokens, num_new) -> jax.Array:
        """One draft ``model_step`` (the pools donated and replaced); its last logits."""
        self.k_pages, self.v_pages, logits, _ = model_step(
            self.model,
            self.k_pages,
            self.v_pages,
            jnp.asarray(table),
            jnp.asarray(lengths),
            jnp.asarray(tokens),
            jnp.asarray(num_new),
        )
        return logits

    def prefill(
        self,
        requests: Sequence[Request],
        table: np.ndarray,
        lengths: np.ndarray,
        tokens: np.ndarray,
        num_new: np.ndarray,
    ) -> None:
        """Run the target's prefill call (its host arrays) through the draft too."""
        if not requests:
            return
        self._run(table, lengths, tokens, num_new)
        for i, r in enumerate(requests):
            r.draft_computed += int(num_new[i])

    def _table(self, requests: Sequence[Request], rows: int, last: int) -> np.ndarray:
        """The page table of a draft call: each request's pages, cut to the bucket holding
        ``last`` tokens (padding rows: none, so their writes are dropped)."""
        pages = bucket(self.page_buckets, -(-last // self.page_size))
        table = np.full((rows, pages), -1, np.int32)
        for i, r in enumerate(requests):
            table[i, : min(len(r.pages), pages)] = r.pages[:pages]
        return table

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[np.ndarray]:
        """``rooms[i]`` (>= 1) draft tokens for each request, whose draft cache lags its
        tokens by one or two (module docstring)."""
        rows = bucket(self.row_buckets, len(requests))
        histories = [(*r.prompt, *r.generated) for r in requests]
        lags = [len(h) - r.draft_computed for h, r in zip(histories, requests, strict=True)]
        if not all(lag in (1, 2) for lag in lags):
            raise RuntimeError(f"DraftRunner: draft caches lag by {lags}, expected 1 or 2")
        width = max(lags)
        tokens, num_new = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, (h, r, lag) in enumerate(zip(histories, requests, lags, strict=True)):
            tokens[i, :lag], num_new[i], lengths[i] = h[len(h) - lag :], lag, r.draft_computed
        last = max(len(h) + room - 1 for h, room in zip(histories, rooms, strict=True))
        table = self._table(requests, rows, last)
        token = np.asarray(_greedy(self._run(table, lengths, tokens, num_new)))
        drafts = [[int(token[i])] for i in range(len(requests))]
        lengths = lengths + num_new
        for j in range(1, max(rooms)):
            live = [i for i, room in enumerate(rooms) if room > j]
            step_table = table.copy()
            step_table[[i for i in range(rows) if i not in live]] = -1  # writes dropped
            ids = np.zeros((rows, 1), np.int32)
            ids[live, 0] = [drafts[i][-1] for i in live]
            new = np.zeros(rows, np.int32)
            new[live] = 1
            token = np.asarray(_greedy(self._run(step_table, lengths, ids, new)))
            for i in live:
                drafts[i].append(int(token[i]))
            lengths = lengths + new
        for r, lag in zip(requests, lags, strict=True):
            r.draft_computed += lag
        return [np.asarray(d, np.int32) for d in drafts]

    def warmup(self, shapes: Sequence[tuple[int, int, int]]) -> None:
        """Compile the draft's calls of ``shapes`` ``(rows, width, pages)`` (rows with no
        tokens and no pages: the pools are unchanged)."""
        for rows, width, pages in shapes:
            self._run(
                np.full((rows, pages), -1, np.int32),
                np.zeros(rows, np.int32),
                np.zeros((rows, width), np.int32),
                np.zeros(rows, np.int32),
            )
