"""KV-cache storage formats: keys / values stored quantized, one scale per cached token and
KV head, each format a :class:`KVCacheDtype` entry of :data:`KV_CACHE_DTYPES`.

A key or value vector ``x`` ``(head_dim,)`` of one token and KV head is stored as codes
``q`` and one float32 scale ``s`` (symmetric absmax, as vLLM's and SGLang's per-token
caches)::

    "auto":     the compute dtype, no scales (today's cache)
    "int8":     s = absmax / 127,  q = round(x / s) in [-127, 127] (int8),  x ~ q * s
    "fp8_e4m3": s = absmax / 448,  q = float8_e4m3fn(x / s) (round to nearest),  x ~ q * s

Both quantized formats store 1 byte per element plus 4 bytes of scale per ``head_dim``
elements: with ``head_dim = 128``, 1.03 bytes per element against bfloat16's 2 and
float32's 4. ``float8_e4m3fn`` is a storage type here: the codes are widened to float32
before use, so it runs wherever XLA converts it (CPU included).

Pools of quantized pages are :class:`QuantizedPages` (codes and scales side by side, a
pytree); ``edl.ops.cached_attention.paged_attention`` reads them: its kernels (native CPU,
Pallas GPU / TPU) take the codes and scales and dequantize each position or page on chip,
``"xla"`` / ``"reference"`` dequantize the pages they gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Shaped

from edl._registry import Registry

__all__ = [
    "KV_CACHE_DTYPES",
    "KVCacheDtype",
    "QuantizedPages",
    "bytes_per_token",
    "dequantize_kv",
    "quantize_kv",
]


@dataclasses.dataclass(frozen=True)
class KVCacheDtype:
    """One KV-cache storage format.

    Attributes:
        name: the ``kv_cache_dtype`` value (``--kv-cache-dtype``).
        storage: the codes' dtype; None: the compute dtype, unquantized (``"auto"``).
        max_code: the largest code magnitude, ``s = absmax / max_code``.
        encode: ``encode(x / s)`` (float32) -> codes of ``storage``.
    """

    name: str
    storage: DTypeLike | None = None
    max_code: float = 1.0
    encode: Callable[[Array], Array] | None = None

    @property
    def quantized(self) -> bool:
        return self.storage is not None


def _int8(x: Float[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    return jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8)


def _fp8(x: Float[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    return jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn)


KV_CACHE_DTYPES: Registry[KVCacheDtype] = Registry(
    "KV-cache dtype",
    [
        KVCacheDtype("auto"),
        KVCacheDtype("int8", jnp.int8, 127.0, _int8),
        KVCacheDtype("fp8_e4m3", jnp.float8_e4m3fn, 448.0, _fp8),
    ],
)


def quantize_kv(
    x: Float[Array, "*lead head_dim"], name: str
) -> tuple[Shaped[Array, "*lead head_dim"], Float[Array, "*lead 1"]]:
    """``x`` (a token's key or value per KV head, ``head_dim`` last) as codes and one float32
    scale per vector: ``(codes, scales)``; an all-zero vector has scale 0 and codes 0."""
    fmt = KV_CACHE_DTYPES.lookup(name, "kv_cache_dtype")
    if not fmt.quantized:
        raise ValueError(f"quantize_kv: {name!r} stores the compute dtype, nothing to quantize")
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / fmt.max_code
    # A zero vector: divide by 1 (codes 0) and keep the scale 0, so it decodes to zeros.
    codes = fmt.encode(x / jnp.where(scale > 0, scale, 1.0))
    return codes, scale


def dequantize_kv(
    codes: Shaped[Array, "*lead head_dim"], scales: Float[Array, "*lead 1"], dtype: DTypeLike
) -> Float[Array, "*lead head_dim"]:
    """``codes * scales`` in ``dtype`` (computed in float32)."""
    return (codes.astype(jnp.float32) * scales.astype(jnp.float32)).astype(dtype)


class QuantizedPages(eqx.Module):
    """A pool of quantized KV pages: ``values`` (codes) ``(*layers, num_pages, page_size,
    kv_heads, head_dim)`` and float32 ``scales`` ``(*layers, num_pages, page_size, kv_heads,
    1)`` (a trailing 1, so page gathers treat both alike). ``format``: the
    ``KV_CACHE_DTYPES`` name (static). ``shape`` / ``ndim`` / ``dtype`` are the codes'."""

    values: Shaped[Array, "*layers num_pages page_size kv_heads head_dim"]
    scales: Float[Array, "*layers num_pages page_size kv_heads 1"]
    format: str = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @classmethod
    def zeros(cls, shape: tuple[int, ...], name: str) -> QuantizedPages:
        """An empty pool of codes ``shape`` in format ``name``."""
        fmt = KV_CACHE_DTYPES.lookup(name, "kv_cache_dtype")
        if not fmt.quantized:
            raise ValueError(f"QuantizedPages: {name!r} is not a quantized KV-cache dtype")
        return cls(jnp.zeros(shape, fmt.storage), jnp.zeros((*shape[:-1], 1), jnp.float32), name)

    def set(self, index: tuple, x: Float[Array, "*lead head_dim"]) -> QuantizedPages:
        """``x`` quantized and written at ``index`` (writes out of range dropped)."""
        codes, scales = quantize_kv(x, self.format)
        return QuantizedPages(
            self.values.at[index].set(codes, mode="drop"),
            self.scales.at[index].set(scales, mode="drop"),
            self.format,
        )


def bytes_per_token(name: str, kv_heads: int, head_dim: int, dtype: DTypeLike) -> int:
    """Bytes one cached token takes per layer (keys and values) in format ``name``, with
    compute dtype ``dtype`` for ``"auto"``."""
    fmt = KV_CACHE_DTYPES.lookup(name, "kv_cache_dtype")
    if not fmt.quantized:
        return 2 * kv_heads * head_dim * np.dtype(dtype).itemsize
    return 2 * kv_heads * (head_dim * np.dtype(fmt.storage).itemsize + 4)
