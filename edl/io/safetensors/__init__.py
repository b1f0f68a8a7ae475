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
``edl.io.files`` (atomic writes).
"""

from edl.io.safetensors.format import (
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
from edl.io.safetensors.reader import CheckpointReader, load_file, open_checkpoint
from edl.io.safetensors.writer import save_file, save_tensors

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
