"""Streaming reader and writer for safetensors checkpoints, single-file or HF-sharded.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(space-padded to a multiple of 8)::

    {"__metadata__": {"format": "pt"},
     "wte": {"dtype": "F32", "shape": [32, 16], "data_offsets": [0, 2048]}, ...}

then the tensors' raw little-endian C-order bytes, contiguous and without holes
(``data_offsets`` count from the end of the header). A sharded Hugging Face checkpoint is
``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``::

    {"metadata": {"total_size": 123}, "weight_map": {"wte": "model-00001-of-00003.safetensors"}}

Nothing here holds a whole file in memory. ``CheckpointReader`` parses and validates every
header when it opens (so corruption surfaces before any data is read) and then reads one tensor
at a time with positioned reads, straight into a preallocated buffer if asked
(``read_into``); ``save_tensors`` plans shards from shapes and dtypes alone and materialises one
tensor at a time while writing, so values may be ``LazyTensor``s produced on demand. Every file
is written to a temporary file in the target directory and moved into place with
``os.replace``. All format problems raise ``CheckpointError`` naming the file and the tensor.
No pickle is involved anywhere. This package depends on nothing else in edl but
``edl.io.formats.files`` (atomic writes).

Why edl keeps its own rather than reading and writing through ``safetensors`` (checked against
safetensors 0.8.0; ``tests/test_io_safetensors.py``, section "What the official library does
not give", pins each point):

- No reading into a caller's buffer. ``safe_open(...).get_tensor`` and ``get_slice(...)[...]``
  return a new array each call (with the ``"pread"`` backend too), so filling one layer of a
  stacked array costs a transient copy of the tensor; ``read_into`` reads straight into it.
- Errors name neither the file nor, for size mismatches, truncation or trailing bytes, the
  tensor ("incomplete metadata, file not fully covered"); holes and overlaps both read "invalid
  offset for tensor". A key that appears twice in the header is accepted, the last one winning.
- One file at a time: ``safe_open`` on a sharded checkpoint's index fails ("header too large").
  huggingface_hub's sharded load/save is torch-only.
- Writing takes every tensor materialised at once (``TensorSpec`` holds raw pointers that must
  stay alive for the call), with no shard planning; ``save_tensors`` streams ``LazyTensor``s.
  ``serialize_file`` does write a temporary file and rename it, but without fsync and leaves
  the file owner-only (``0o600``); ``edl.io.formats.files.atomic_file`` fsyncs and honours the
  umask.

Files either side writes are read bit-identically by the other (the interop tests in the same
file, bf16 and fp8 included through ``safetensors.torch``).
"""

from edl.io.formats.safetensors.format import (
    DTYPES,
    MAX_HEADER_SIZE,
    CheckpointError,
    LazyTensor,
    MissingTensorError,
    StrPath,
    SupportsArray,
    TensorInfo,
    TensorLike,
    parse_size,
)
from edl.io.formats.safetensors.reader import CheckpointReader, load_file, open_checkpoint
from edl.io.formats.safetensors.writer import save_file, save_tensors

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "CheckpointError",
    "CheckpointReader",
    "LazyTensor",
    "MissingTensorError",
    "StrPath",
    "SupportsArray",
    "TensorInfo",
    "TensorLike",
    "load_file",
    "open_checkpoint",
    "parse_size",
    "save_file",
    "save_tensors",
]
