"""Pallas kernels for TPU (Mosaic): flash attention (forward and backward), decode and paged
decode attention, with ``edl.kernels``' semantics and layouts; the gated delta rule's chunk
scan, forward and backward (``edl.kernels.tpu.delta_rule``)."""

import jax.numpy as jnp
import numpy as np

from edl.kernels.tpu.decode_attention import decode_attention
from edl.kernels.tpu.flash_attention import BlockSizes, flash_attention
from edl.kernels.tpu.paged_attention import paged_decode_attention

__all__ = ["DTYPES", "BlockSizes", "decode_attention", "flash_attention", "paged_decode_attention"]

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the TPU kernels take
