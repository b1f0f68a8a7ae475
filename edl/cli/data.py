"""``--data`` / ``--eval-data`` of ``edl train``: files or a ``datasets`` name, tokenized
once (cached on disk) and batched by a resumable ``TokenBatches``."""

from __future__ import annotations

import glob
from pathlib import Path

from edl._hub import hub_offline, is_repo_id, no_such_path, offline_error
from edl.cli.config import CommandError, TrainConfig
from edl.cli.distributed import process_split
from edl.text import Tokenizer, data_files, hf_dataset, load_tokenized
from edl.text.sources import Source
from edl.train import TokenBatches

__all__ = ["batches"]


def source_of(spec: str) -> Source:
    """The records ``spec`` names: local files (a file, a directory or a glob), else a
    Hugging Face ``datasets`` name, ``NAME`` or ``NAME:SPLIT`` (default split ``train``).
    A ``NAME`` that is not repo-id-shaped (``edl._hub.is_repo_id``: ``nope.jsonl``,
    ``data/x/y``) is a missing local path: ``FileNotFoundError`` naming it, no hub look-up;
    with ``HF_HUB_OFFLINE=1`` a hub name missing from the cache says so."""
    if Path(spec).expanduser().exists() or glob.has_magic(spec):
        return data_files(spec)
    name, _, split = spec.partition(":")
    if not is_repo_id(name):
        raise no_such_path(spec)
    try:
        return hf_dataset(name, split=split or "train")
    except (OSError, ValueError, ConnectionError) as e:
        if hub_offline():
            raise offline_error(name, "dataset") from e
        raise


def batches(config: TrainConfig, spec: str, tokenizer: Tokenizer, *, shuffle: bool) -> TokenBatches:
    """``config.batch_size`` rows of ``config.seq_len`` tokens from ``spec``'s records, read
    as ``config.format``; shuffled and repeated for training, one ordered pass otherwise;
    with several processes, this process's rows of each batch.
    ``CommandError`` names ``spec`` when it cannot be read."""
    try:
        dataset = load_tokenized(source_of(spec), tokenizer, format=config.format)
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{spec}: {e}") from None
    if len(dataset) == 0:
        raise CommandError(f"{spec}: no records")
    return TokenBatches(
        dataset,
        batch_size=config.batch_size,
        max_length=config.seq_len,
        tokenizer=tokenizer,
        pack=config.packing,
        shuffle=shuffle,
        seed=config.seed,
        repeat=shuffle,
        **process_split(),
    )
