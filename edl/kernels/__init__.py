"""Pallas kernels: flash attention (forward + backward), decode and paged decode attention.

Each kernel lowers through Triton on NVIDIA GPUs and runs with ``interpret=True`` on CPU;
``edl.ops.attention`` is the entry point models use. ``edl.kernels.native`` holds the one
kernel written for CPU instead: paged attention reading the page pool in place (C++ through
XLA's FFI, built on first use), which ``edl.ops.paged_attention`` picks on CPU.
"""

from edl.kernels import native
from edl.kernels.decode_attention import decode_attention
from edl.kernels.flash_attention import BlockSizes, default_block_sizes, flash_attention
from edl.kernels.paged_attention import gather_pages, paged_decode_attention

__all__ = [
    "BlockSizes",
    "decode_attention",
    "default_block_sizes",
    "flash_attention",
    "gather_pages",
    "native",
    "paged_decode_attention",
]
