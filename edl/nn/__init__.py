"""Equinox layers (HF weight layouts), built with ``Module.init(..., key=...)``."""

from edl.nn.layers import Embedding, Linear, RMSNorm

__all__ = ["Embedding", "Linear", "RMSNorm"]
