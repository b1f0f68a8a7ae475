"""Text: tokenizers, the encoding of supervised fine-tuning examples, and training data from
files and datasets. Pure Python and numpy: no jax; transformers only inside
:func:`load_tokenizer` (the ``edl-jax[text]`` extra), ``datasets`` only inside
:func:`hf_dataset` (the ``edl-jax[data]`` extra).

- ``tokenizer``: the :class:`Tokenizer` protocol and :class:`ByteTokenizer` (the demo's);
- ``hf``: :func:`load_tokenizer` and :class:`HFTokenizer`, transformers' tokenizers under
  edl's names, token for token identical;
- ``chat``: :data:`~edl.text.chat.ROLES`, the chat roles that training records and the
  server's requests may take (one table for both);
- ``sft``: :func:`encode_completion` and :func:`encode_chat`, ``input_ids`` with
  ``labels`` (:data:`IGNORE_INDEX` where no loss is taken);
- ``preference``: :func:`encode_preference`, a ``{"prompt", "chosen", "rejected"}``
  record as prompt / chosen / rejected token ids, as TRL's ``DPOTrainer`` makes them;
- ``sources``: records (text, prompt / completion, chat, preference) from text files,
  JSON Lines / JSON files (:func:`data_files`) and ``datasets`` (:func:`hf_dataset`),
  validated by :func:`read_records` (a JSON Lines line at most ``MAX_LINE_BYTES``,
  ``MAX_JSON_DEPTH`` deep);
- ``dataset``: :func:`load_tokenized`, records tokenized once into a
  :class:`TokenizedDataset` cached on disk (safetensors + JSON), the documents that
  ``edl.train.TokenBatches`` batches.
"""

from edl.text.dataset import TokenizedDataset, load_tokenized
from edl.text.hf import HFTokenizer, load_tokenizer
from edl.text.preference import encode_preference
from edl.text.sft import IGNORE_INDEX, encode_chat, encode_completion
from edl.text.sources import data_files, hf_dataset, read_records
from edl.text.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenizedDataset",
    "Tokenizer",
    "data_files",
    "encode_chat",
    "encode_completion",
    "encode_preference",
    "hf_dataset",
    "load_tokenized",
    "load_tokenizer",
    "read_records",
]
