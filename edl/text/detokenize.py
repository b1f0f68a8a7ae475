"""Incremental detokenization with OpenAI's stop strings: the one used by the server
(``edl.serve``) and by ``edl.generate.stream_text``.

``IncrementalText(tokenizer, stop=...)`` takes the new token ids as the engine returns
them and gives back the text that is now final. Decoding is windowed, as TGI's and vLLM's:
the text of ids ``[prefix, read)`` is known, the new text is ``decode(ids[prefix:])`` past
``decode(ids[prefix:read])`` (decoding from ``prefix`` keeps what a tokenizer does at the
start of a text, such as SentencePiece's dropped leading space, out of the delta), and it
is held back while it ends in U+FFFD (an incomplete UTF-8 character a later token may
complete). So each push decodes a few tokens, not the whole reply. Text that may still
grow into a stop string is held back too; when a stop string appears, the text ends just
before it (OpenAI excludes it) and ``stopped`` is set: the caller aborts the request.

The pieces concatenate to the text a plain (non-streamed) reply returns, because both are
built by this class; that is ``decode(all ids)`` whenever decoding more ids only appends
text (byte-level BPE, UTF-8 bytes, SentencePiece without space clean-up).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from edl.text.tokenizer import ByteTokenizer, Detokenizer

__all__ = ["IncrementalText", "decode"]

_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


def decode(tokenizer: Detokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode(ids)``, special tokens skipped unless asked (``ByteTokenizer``
    always skips its own)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


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
        tokenizer: ``decode(ids)`` (``HFTokenizer`` or ``ByteTokenizer``).
        stop: the request's stop strings (empty ones are not allowed).
        stop_token_ids: ids that end generation (EOS); they are left out of the text.
        skip_special_tokens: leave special tokens out of the text (the default).
    """

    def __init__(
        self,
        tokenizer: Detokenizer,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"IncrementalText: stop strings must be non-empty, got {stop!r}")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the decode window: ids[prefix:read] are decoded
        self.decoded = ""  # the text of ids[:read]
        self.text = ""  # the text released so far (a prefix of decoded)
        self.stopped = False  # a stop string was found: the reply is over

    def _advance(self, final: bool) -> None:
        """Decode the ids past ``read`` onto ``decoded`` (unless they end mid-character and
        more may come)."""
        known = decode(self.tokenizer, self.ids[self.prefix : self.read], self.skip_special_tokens)
        window = decode(self.tokenizer, self.ids[self.prefix :], self.skip_special_tokens)
        if len(window) > len(known) and (final or not window.endswith(_REPLACEMENT)):
            self.decoded += window[len(known) :]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add the engine's new ids; returns the newly final text (maybe ``""``)."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in new_ids if int(i) not in self.stop_token_ids)
        self._advance(final=False)
        fresh = self.decoded[len(self.text) :]
        hits = [i for i in (fresh.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(fresh[: min(hits)])
        return self._release(fresh[: len(fresh) - _held_back(fresh, self.stop)])

    def end(self) -> str:
        """The rest when generation ended without a stop string (held-back text and a
        trailing incomplete character included, as ``decode`` gives them)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(self.decoded[len(self.text) :])

    def _release(self, piece: str) -> str:
        self.text += piece
        return piece
