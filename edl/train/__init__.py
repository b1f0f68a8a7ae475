"""Training: train/eval steps, the loop, and the data pipeline (byte tokenizer, default
corpus, collators, resumable batch iterators)."""

from edl.train.data import (
    IGNORE_INDEX,
    TokenBatches,
    batches_from_iterable,
    pack_sequences,
    pad_batch,
)
from edl.train.loop import Hooks, NonFiniteLossError, train
from edl.train.step import (
    OptimizerConfig,
    global_norm,
    make_eval_step,
    make_optimizer,
    make_schedule,
    make_train_step,
)
from edl.train.text import (
    ByteTokenizer,
    Tokenizer,
    default_corpus_files,
    load_corpus,
    split_corpus,
)

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Hooks",
    "NonFiniteLossError",
    "OptimizerConfig",
    "TokenBatches",
    "Tokenizer",
    "batches_from_iterable",
    "default_corpus_files",
    "global_norm",
    "load_corpus",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "pack_sequences",
    "pad_batch",
    "split_corpus",
    "train",
]
