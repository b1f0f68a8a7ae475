"""The engine's host-side page allocator: a free list, reference counts and a prefix cache.

Pages are handed out lowest id first. A page holding a whole, computed block of
``page_size`` prompt tokens can be *published* under the hash of the prompt up to and
including that block (vLLM's block hash: a chain over page-aligned token blocks, so equal
hashes mean equal prefixes); a later request whose prompt starts with the same blocks takes
those pages instead of computing them again (``match``), and every user holds a reference.

When its last user lets go, a published page keeps its block and stays in the prefix cache,
unused, until a fresh page is needed and no never-cached one is left: then the least
recently released cached page is evicted and handed out (vLLM's evictor). So a system
prompt shared by requests that never overlap in time is computed once; a cached page counts
as free (``num_free``), and a page without a published block returns to the free list at
once. Host state by nature (Python dicts and lists), never traced.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["PagePool", "block_hashes"]


def block_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hash of each whole block of ``page_size`` tokens: ``h[j]`` identifies
    ``tokens[: (j + 1) * page_size]``."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        block = np.asarray(tokens[start : start + page_size], np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


class PagePool:
    """``num_pages`` pages: which are free, how many users each has, and the prefix cache
    (block hash -> page; unused cached pages in least recently released order)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"PagePool: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: lowest id first
        self._refs = np.zeros(num_pages, np.int64)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # Unused pages that still hold a published block, least recently released first.
        self._unused_cached: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: never-cached ones and unused cached ones."""
        return len(self._free) + len(self._unused_cached)

    @property
    def num_cached(self) -> int:
        """Pages holding a published block (in use or not)."""
        return len(self._hash_of)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh pages with one user each, never-cached ones first, then evicting
        the least recently released cached ones (ValueError if fewer are free)."""
        if count > self.num_free:
            raise ValueError(f"PagePool: {count} pages wanted, {self.num_free} free")
        pages = [heapq.heappop(self._free) for _ in range(min(count, len(self._free)))]
        while len(pages) < count:
            page, _ = self._unused_cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            pages.append(page)
        self._refs[pages] = 1
        return pages

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of ``hashes``, each given one more user
        (an unused one leaves the eviction order)."""
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
            self._unused_cached.pop(page, None)
        self._refs[pages] += 1
        return pages

    def publish(self, page: int, block_hash: bytes) -> None:
        """Offer ``page`` (in use, holding the block ``block_hash`` names) to later
        requests; a no-op when that block is cached already (in another page)."""
        if self._refs[page] < 1:
            raise ValueError(f"PagePool.publish: page {page} is not in use")
        if block_hash not in self._by_hash and page not in self._hash_of:
            self._by_hash[block_hash] = page
            self._hash_of[page] = block_hash

    def release(self, pages: Sequence[int]) -> None:
        """Drop one user of each page; a page left with none is free again, and keeps its
        published block in the cache until it is evicted (module docstring)."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"PagePool.release: page {page} is already free")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._unused_cached[page] = None
                else:
                    heapq.heappush(self._free, page)

    def users(self, page: int) -> int:
        return int(self._refs[page])
