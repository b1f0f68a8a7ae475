"""Incremental detokenization with OpenAI's stop strings, for one request.

``IncrementalText(tokenizer, stop=...)`` takes the new token ids as the engine returns
them and gives back the text that is now final: the decoded text of all ids so far, less
a trailing incomplete UTF-8 character (U+FFFD, which a later token may complete) and less
a trailing piece that may still grow into a stop string. When a stop string appears, the
text ends just before it (OpenAI excludes it) and ``stopped`` is set: the caller aborts
the request. The pieces concatenate to the text a plain (non-streamed) reply returns,
because both are built by this class.

Decoding the whole ids at each push is O(n^2) in the reply length; fine for replies of a
few thousand tokens (a windowed decode, as vLLM's, is the known improvement).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from edl.text.tokenizer import ByteTokenizer

__all__ = ["IncrementalText"]

_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):  # it always skips its special ids
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class IncrementalText:
    """Final text of a growing reply; see the module docstring.

    Args:
        tokenizer: ``decode(ids)`` (``HFTokenizer``: special tokens skipped).
        stop: the request's stop strings (empty ones are not allowed).
        stop_token_ids: ids that end generation (EOS); they are left out of the text.
    """

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (),
                 stop_token_ids: Iterable[int] = ()) -> None:  # fmt: skip
        if any(not s for s in stop):
            raise ValueError(f"IncrementalText: stop strings must be non-empty, got {stop!r}")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ids: list[int] = []
        self.text = ""  # the text released so far
        self.stopped = False  # a stop string was found: the reply is over

    def push(self, new_ids: Sequence[int]) -> str:
        """Add the engine's new ids; returns the newly final text (maybe ``""``)."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in new_ids if int(i) not in self.stop_token_ids)
        decoded = _decode(self.tokenizer, self.ids)
        stable = decoded.rstrip(_REPLACEMENT)
        fresh = stable[len(self.text) :]
        hits = [i for i in (fresh.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(fresh[: min(hits)])
        return self._release(fresh[: len(fresh) - _held_back(fresh, self.stop)])

    def end(self) -> str:
        """The rest when generation ended without a stop string (held-back text included)."""
        if self.stopped:
            return ""
        return self._release(_decode(self.tokenizer, self.ids)[len(self.text) :])

    def _release(self, piece: str) -> str:
        self.text += piece
        return piece
