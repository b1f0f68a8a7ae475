"""The tokenizer protocol edl's data code needs, and the byte tokenizer of the embedded demo.

Hugging Face tokenizers meet the same protocol through :class:`edl.text.HFTokenizer`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "Detokenizer", "Tokenizer"]


# A UTF-16 surrogate alone in a str: JSON's \ud800 escape decodes to one (a pair of escapes
# decodes to one character), but it is no Unicode character and has no UTF-8 encoding.
_SURROGATE = re.compile("[\ud800-\udfff]")


def checked_text(text: str, what: str) -> str:
    """``text``, checked to be Unicode text every tokenizer can encode: ``ValueError``
    naming ``what`` (e.g. ``"data.jsonl:3: field 'text'"``), the first lone surrogate
    (``U+D800``..``U+DFFF``) and its character index."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{what} has a lone surrogate U+{ord(found.group()):04X} at character "
            f"{found.start()}: not Unicode text (it has no UTF-8 encoding)"
        )
    return text


@runtime_checkable
class Tokenizer(Protocol):
    """What the batching code needs from a tokenizer (``ByteTokenizer`` and ``HFTokenizer``
    are two).

    ``encode(text, *, add_bos, add_eos)`` returns token ids, with no special token unless
    asked for; ``pad_id`` fills padding.
    """

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...


@runtime_checkable
class Detokenizer(Protocol):
    """What turning token ids back into text needs: ``decode(ids)`` (``ByteTokenizer`` and
    ``HFTokenizer`` are two; ``HFTokenizer``'s also takes ``skip_special_tokens``)."""

    def decode(self, ids: Sequence[int], /) -> str: ...


def checked_ids(ids: Sequence[int] | np.ndarray, vocab_size: int, where: str = "") -> np.ndarray:
    """``ids`` flattened to ``(n,)``, checked to be integers in ``[0, vocab_size)`` for ``decode``;
    ``ValueError`` names the first id outside (and ``where``, the vocabulary's source)."""
    array = np.asarray(ids).reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"decode: ids must be integers, got dtype {array.dtype}")
    bad = array[(array < 0) | (array >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"decode: id {int(bad[0])} is outside the vocabulary [0, {vocab_size}){where}"
        )
    return array


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: ids ``0..255`` are raw bytes, then ``pad``, ``bos``, ``eos``.

    ``vocab_size == 259``. Every string round-trips: ``decode(encode(s)) == s``.
    """

    pad_id: ClassVar[int] = 256
    bos_id: ClassVar[int] = 257
    eos_id: ClassVar[int] = 258
    vocab_size: ClassVar[int] = 259
    name: ClassVar[str] = "bytes"

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes, optionally framed by ``bos_id`` / ``eos_id``.

        Raises ``ValueError`` for a lone surrogate in ``text`` (:func:`checked_text`), as
        :class:`~edl.text.HFTokenizer` does."""
        ids = list(checked_text(text, "encode: text").encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (any shape is flattened); special ids are skipped.

        Invalid UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD. Raises
        ``ValueError`` for an id outside ``[0, vocab_size)``.
        """
        array = checked_ids(ids, self.vocab_size)
        data = array[array < 256].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")
