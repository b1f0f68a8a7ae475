"""``KVCacheOptions``: how the KV cache stores keys / values, for ``edl generate`` and
``edl serve`` (``--kv-cache-dtype``), the library's ``generate(..., kv_cache_dtype=)`` and
``Engine(..., kv_cache_dtype=)``.

Declared here, with no jax, so ``--help`` lists the flag before jax is imported; the formats
themselves are ``edl.ops.kv_quant.KV_CACHE_DTYPES``.
"""

from __future__ import annotations

import dataclasses

from edl._settings import Registered, check_options, option

__all__ = ["KVCacheOptions"]


@dataclasses.dataclass(frozen=True)
class KVCacheOptions:
    """The KV cache's storage format: ``auto`` (the model's dtype), ``int8`` or ``fp8_e4m3``
    (quantized pages, one float32 scale per token and KV head; the paged cache only)."""

    kv_cache_dtype: str = option(
        "auto",
        "how the KV cache stores keys / values: auto (the compute dtype), int8 or fp8_e4m3 "
        "(quantized pages, about half of bfloat16's bytes; the paged kernels read them)",
        registry=Registered("edl.ops.kv_quant:KV_CACHE_DTYPES"),
    )

    def __post_init__(self) -> None:
        check_options(self)
