"""Hugging Face tokenizers behind edl's :class:`~edl.text.Tokenizer` protocol.

:func:`load_tokenizer` reads a model's tokenizer files with transformers' own
``AutoTokenizer``, so token ids, special tokens and chat templates are exactly
transformers'; :class:`HFTokenizer` puts edl's names on it (``encode(..., add_bos=)``,
``pad_id``, ``bos_id``, ``eos_id``, ``vocab_size``). edl keeps no tokenizer of its own here:
re-implementing normalizers, pre-tokenizers and Jinja chat templates would only be a second
place for them to differ.

transformers is the optional extra ``edl-jax[text]``; it is imported on the first
:func:`load_tokenizer`, never by ``import edl`` or ``import edl.text``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edl._hub import hub_offline, is_repo_id, no_such_path, offline_error
from edl.text.tokenizer import checked_ids, checked_text

__all__ = ["HFTokenizer", "load_tokenizer"]

# Tokenizer files a directory must hold one of (transformers reads the others beside them).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What `save` writes: JSON, Jinja templates and text vocabularies; a binary file only when
# the tokenizer was read from one of the same name.
_TEXT_SUFFIXES = frozenset({".json", ".jinja", ".txt"})


class HFTokenizer:
    """A transformers tokenizer (``hf``) under edl's names; ids are exactly transformers'.

    Attributes:
        hf: the ``transformers`` tokenizer (a fast one, backed by the ``tokenizers``
            library); use it for anything edl does not name.
        source: the directory or hub repo id it was read from.
        special_ids: ids of every special token: the named ones (bos, eos, pad, ...) and
            every added token marked special (chat markers such as ``<|im_end|>``).
        adds_bos: whether transformers' default encoding (``tokenizer(text)``, with
            ``add_special_tokens=True``) starts with BOS, as Llama's does: the model was
            trained with it.
    """

    def __init__(self, hf: Any, source: str, *, source_files: frozenset[str] = frozenset()):
        """Wrap ``hf`` (a fast transformers tokenizer) read from ``source``, whose directory
        held ``source_files`` (names; the binary files among them ``save`` may write back)."""
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                f"{source}: transformers gave a slow (pure Python) tokenizer, {type(hf).__name__}; "
                "edl needs a fast one (tokenizer.json, or files the `tokenizers` library converts)"
            )
        self.hf = hf
        self.source = source
        self._source_files = source_files
        self.special_ids: frozenset[int] = frozenset(
            [*hf.all_special_ids, *(i for i, t in hf.added_tokens_decoder.items() if t.special)]
        )
        first = hf("a", add_special_tokens=True)["input_ids"][:1]
        self.adds_bos: bool = (
            self.bos_id is not None
            and first == [self.bos_id]
            and first != hf("a", add_special_tokens=False)["input_ids"][:1]
        )

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"

    @property
    def name(self) -> str:
        """The tokenizer's source (a directory or repo id), for logs and run metadata."""
        return self.source

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(tokenizer)``, which can differ
        from the model's embedding rows: models often pad those to a multiple of 64)."""
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence token's id, or None when the tokenizer has none."""
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence token's id, or None when the tokenizer has none. A chat model
        may end its turns with another token (``generation_config.json`` lists it)."""
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int:
        """The pad token's id, else the EOS id: many chat models define no pad token, and
        padding is masked out anyway. Raises ``ValueError`` when there is neither."""
        pad = self.hf.pad_token_id
        if pad is None:
            pad = self.hf.eos_token_id
        if pad is None:
            raise ValueError(f"{self.source}: the tokenizer has neither a pad nor an eos token")
        return pad

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template (the default one when there are several), or None."""
        template = self.hf.chat_template
        if isinstance(template, Mapping):
            template = template.get("default")
        return template

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` with no special token added, then ``bos_id`` prepended when
        ``add_bos`` and ``eos_id`` appended when ``add_eos``.

        Special tokens written in ``text`` (``"</s>"``) are read as such, as transformers
        does. ``encode(t)`` is ``tokenizer.encode(t, add_special_tokens=False)``; for a
        tokenizer whose default adds BOS (``adds_bos``, Llama), ``encode(t, add_bos=True)``
        is transformers' default ``tokenizer(t)["input_ids"]``: ``add_bos`` adds exactly
        one BOS and nothing else. Raises ``ValueError`` when asked for a BOS or EOS the
        tokenizer lacks, and for a lone surrogate in ``text``
        (:func:`~edl.text.tokenizer.checked_text`, as :class:`~edl.text.ByteTokenizer`
        does; the ``tokenizers`` library would raise a bare ``TypeError``).
        """
        ids = list(self.hf.encode(checked_text(text, "encode: text"), add_special_tokens=False))
        if add_bos:
            ids.insert(0, self._special("bos"))
        if add_eos:
            ids.append(self._special("eos"))
        return ids

    def _special(self, kind: str) -> int:
        value = getattr(self, f"{kind}_id")
        if value is None:
            raise ValueError(f"{self.source}: add_{kind}=True, but the tokenizer has no {kind} id")
        return value

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (any shape is flattened), as transformers' ``decode`` gives it.

        Raises ``ValueError`` for an id outside ``[0, vocab_size)`` (transformers would
        silently drop it).
        """
        array = checked_ids(ids, self.vocab_size, f" of {self.source}")
        return self.hf.decode(array.tolist(), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text for ``messages`` (``{"role": ..., "content": ...}``
        dicts): transformers' ``apply_chat_template(..., tokenize=False)``.

        ``add_generation_prompt`` ends the text with the assistant turn's header, ready for
        generation; ``tools`` are JSON schemas for templates that take them;
        ``template_kwargs`` go to the template (``enable_thinking=False``, ...).
        """
        self._require_template()
        return self.hf.apply_chat_template(
            list(messages),
            tools=None if tools is None else list(tools),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs or {}),
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`'s text, exactly transformers'
        ``apply_chat_template(messages, ...)`` (the template writes any BOS itself, so no
        special token is added around it)."""
        self._require_template()
        out = self.hf.apply_chat_template(
            list(messages),
            tools=None if tools is None else list(tools),
            tokenize=True,
            return_dict=True,
            add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs or {}),
        )
        return list(out["input_ids"])

    def _require_template(self) -> None:
        if self.chat_template is None:
            raise ValueError(
                f"{self.source}: the tokenizer has no chat template (tokenizer_config.json's "
                "'chat_template' or chat_template.jinja)"
            )

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write the tokenizer files into ``directory`` (created if missing); returns their
        paths, sorted.

        The files are what transformers' ``save_pretrained`` writes for a fast tokenizer
        (``legacy_format=False``: ``tokenizer.json``, ``tokenizer_config.json``, the chat
        template, and with transformers 4 ``special_tokens_map.json``), so
        ``AutoTokenizer.from_pretrained(directory)`` reads the same tokenizer back. They are
        written to a temporary directory beside ``directory`` and each moved into place
        with ``os.replace``, so no reader sees a half-written file. A binary file (a
        sentencepiece ``tokenizer.model``) is written only when the tokenizer was read from
        one; anything else but JSON, Jinja and text raises ``ValueError``.
        """
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
        try:
            self.hf.save_pretrained(staging, legacy_format=False)
            written = sorted(p for p in staging.iterdir() if p.is_file())
            unexpected = [
                p.name
                for p in written
                if p.suffix not in _TEXT_SUFFIXES and p.name not in self._source_files
            ]
            if unexpected:
                raise ValueError(
                    f"save: transformers wrote {unexpected} for {self.source}; edl writes "
                    "only JSON, Jinja and text files (and binaries the tokenizer came with)"
                )
            for path in written:
                os.replace(path, target / path.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return [target / p.name for p in written]


def load_tokenizer(
    path_or_repo: str | os.PathLike[str],
    *,
    revision: str | None = None,
    local_files_only: bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
) -> HFTokenizer:
    """The tokenizer of a model directory or hub repo, read by transformers' ``AutoTokenizer``.

    A local directory must hold tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json``, ...). What is not a repo id (``edl._hub.is_repo_id``:
    absolute paths, ``./``, ``~``, more than one ``/``, a file extension) is a local path,
    as in :func:`edl.io.formats.hf.from_pretrained`. A repo id is fetched through the hub (or its
    local cache) at ``revision``; ``local_files_only=None`` leaves the choice to
    transformers (``HF_HUB_OFFLINE``). Raises ``FileNotFoundError`` naming a missing path or
    a directory without tokenizer files, and ``ImportError`` naming the extra to install
    when transformers is missing.
    """
    text = os.fspath(path_or_repo)
    path = Path(text).expanduser()
    if path.is_dir():
        source_files = frozenset(p.name for p in path.iterdir() if p.is_file())
        if not source_files & set(_TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{path}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})"
            )
        where: str = str(path)
    elif path.exists():
        raise ValueError(f"{path} is a file; pass the directory that holds the tokenizer files")
    elif not is_repo_id(text):
        raise no_such_path(text)
    else:
        where, source_files = text, frozenset()
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            "edl.text.load_tokenizer needs transformers: pip install 'edl-jax[text]'"
        ) from e
    options: dict[str, Any] = {"revision": revision, "cache_dir": cache_dir, "token": token}
    if local_files_only is not None:
        options["local_files_only"] = local_files_only
    options = {k: v for k, v in options.items() if v is not None}
    try:
        # Tokenizer files are data: never import a class an ``auto_map`` names.
        hf = AutoTokenizer.from_pretrained(where, use_fast=True, trust_remote_code=False, **options)
    except OSError as e:  # transformers' errors for missing files and unknown repos
        if not source_files and hub_offline():
            raise offline_error(where) from e
        raise OSError(f"{where}: transformers could not read a tokenizer: {e}") from e
    return HFTokenizer(hf, where, source_files=source_files)
