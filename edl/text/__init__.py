"""Text: tokenizers and the encoding of supervised fine-tuning examples. Pure Python and
numpy: no jax, and transformers only inside :func:`load_tokenizer` (the ``edl[text]`` extra).

- ``tokenizer``: the :class:`Tokenizer` protocol and :class:`ByteTokenizer` (the demo's);
- ``hf``: :func:`load_tokenizer` and :class:`HFTokenizer`, transformers' tokenizers under
  edl's names, token for token identical;
- ``sft``: :func:`encode_completion` and :func:`encode_chat`, ``input_ids`` with
  ``labels`` (:data:`IGNORE_INDEX` where no loss is taken).
"""

from edl.text.hf import HFTokenizer, load_tokenizer
from edl.text.sft import IGNORE_INDEX, Example, encode_chat, encode_completion
from edl.text.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Example",
    "HFTokenizer",
    "Tokenizer",
    "encode_chat",
    "encode_completion",
    "load_tokenizer",
]
