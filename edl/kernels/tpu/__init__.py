"""Pallas kernels for TPU (Mosaic): flash attention (forward and backward), decode and paged
decode attention, with ``edl.kernels``' semantics and layouts."""
