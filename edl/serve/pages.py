"""The engine's host-side page allocator: a free list, reference counts and a prefix cache.

Pages are handed out lowest id first. A page holding a whole, computed block of
``page_size`` prompt tokens can be *published* under the hash of the prompt up to and
including that block (vLLM's block hash: a chain over page-aligned token blocks, so equal
hashes mean equal prefixes); a later request whose prompt starts with the same blocks takes
those pages instead of computing them again (``match``), and every user holds a reference.
A page returns to the free list, and leaves the prefix cache, when its last user lets go.
Host state by nature (Python dicts and lists), never traced.
"""

from __future__ import annotations

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
    (block hash -> page)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"PagePool: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: lowest id first
        self._refs = np.zeros(num_pages, np.int64)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh pages with one user each (ValueError if fewer are free)."""
        if count > len(self._free):
            raise ValueError(f"PagePool: {count} pages wanted, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of ``hashes``, each given one more user."""
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
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
        """Drop one user of each page; pages left with none are free again."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"PagePool.release: page {page} is already free")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                block_hash = self._hash_of.pop(page, None)
                if block_hash is not None:
                    del self._by_hash[block_hash]
                heapq.heappush(self._free, page)

    def users(self, page: int) -> int:
        return int(self._refs[page])
