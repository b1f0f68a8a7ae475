"""Log-probs in replies: the engine's ``Logprob`` entries as token texts, and OpenAI's two
shapes of them (``/v1/completions``' legacy object and chat's ``content`` list). Plain data,
no web framework; the server (``edl.serve.server``) keeps one :class:`ReplyLogprobs` per
reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edl.serve.types import Logprob, RequestOutput
from edl.text.tokenizer import Detokenizer

__all__ = ["ReplyLogprobs", "chat_logprobs", "completion_logprobs"]

FLOOR = -9999.0  # JSON has no -Infinity: lower log-probs are sent as this (as vLLM does)


# A token's log-prob, top alternatives and text, as the server hands them to the builders:
# ``(text, logprob or None (an echoed prompt's first token), [(text, logprob), ...])``.
TokenLogprob = tuple[str, float | None, list[tuple[str, float]]]


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object of ``/v1/completions``: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (per token a dict text -> log-prob of the top ones
    and the token itself, as vLLM; None where the log-prob is None) and ``text_offset`` (each
    token's start in the choice's text, counted from ``offset``)."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for text, logprob, top in entries:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if logprob is None else {**dict(top), text: logprob})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}, ...]}, ...]}``."""
    return {
        "content": [
            {**_token(text, logprob or 0.0), "top_logprobs": [_token(t, p) for t, p in top]}
            for text, logprob, top in entries
        ]
    }


class ReplyLogprobs:
    """One reply's log-prob entries as ``TokenLogprob`` (each token decoded alone), kept
    until :meth:`sent`: ``kind`` "completion" or "chat", the request's ``prompt`` ids (an
    echoed prompt's entries, ``prompt_entries``, come with the engine's first output)."""

    def __init__(self, tokenizer: Detokenizer, kind: str, prompt: Sequence[int]) -> None:
        self.tokenizer, self.kind, self.prompt = tokenizer, kind, prompt
        self.pending: list[TokenLogprob] = []
        self.prompt_entries: list[TokenLogprob] = []

    def _entry(self, entry: Logprob | None, token_id: int) -> TokenLogprob:
        text = self.tokenizer.decode([token_id])
        if entry is None:  # an echoed prompt's first token
            return text, None, []
        top = [(self.tokenizer.decode([i]), max(p, FLOOR)) for i, p in entry.top]
        return text, max(entry.logprob, FLOOR), top

    def take(self, out: RequestOutput) -> None:
        """Keep an engine output's entries (generated, and the prompt's when it has them)."""
        if out.prompt_logprobs is not None:
            pairs = zip(out.prompt_logprobs, self.prompt, strict=True)
            self.prompt_entries = [self._entry(e, t) for e, t in pairs]
        if out.logprobs is not None:
            self.pending += [self._entry(e, e.token_id) for e in out.logprobs]

    def echo(self) -> None:
        """Put the prompt's entries before the pending ones (``echo``)."""
        self.pending = self.prompt_entries + self.pending

    def sent(self, offset: int) -> dict[str, Any]:
        """The pending entries in the request's shape (legacy completions' with text offsets
        from ``offset``, or chat's), forgotten here."""
        entries, self.pending = self.pending, []
        if self.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, offset)
