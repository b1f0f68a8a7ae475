"""Pallas kernels: flash attention (forward + backward), decode and paged decode attention.

The kernels here are written for Triton: compiled in programs lowered for GPUs, run with
``interpret=True`` elsewhere (CPU). ``edl.kernels.tpu`` holds the same three written for TPUs
(Mosaic), ``edl.kernels.native`` the ones written for CPUs (C++ through XLA's FFI, built on
first use): blocked attention with its backward pass, and paged attention reading the page
pool in place. ``edl.ops.attention`` / ``cached_attention`` / ``paged_attention`` are the
entry points models use; they pick among these by the platform a program is lowered for
(``edl.ops.dispatch``).
"""

from edl.kernels import native, tpu
from edl.kernels.decode_attention import decode_attention
from edl.kernels.flash_attention import BlockSizes, flash_attention
from edl.kernels.paged_attention import paged_decode_attention

__all__ = [
    "BlockSizes",
    "decode_attention",
    "flash_attention",
    "native",
    "paged_decode_attention",
    "tpu",
]
