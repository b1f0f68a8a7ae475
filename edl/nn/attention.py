"""Grouped-query self-attention with RoPE (HF layout), calling ``edl.ops.attention``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.nn.layers import Linear, RMSNorm
from edl.ops.attention import SegmentIds, attention
from edl.ops.block_attention import BidirectionalBlocks
from edl.ops.rope import apply_rope

__all__ = ["Attention", "KVCacheLike"]


@runtime_checkable
class KVCacheLike(Protocol):
    """What a model needs of a KV cache (``edl.generate.KVCache`` / ``PagedKVCache``; see
    ``edl.generate.cache`` for the call order). Pure: every method returns a new cache."""

    lengths: jax.Array  # (batch,) valid tokens per row

    def reserve(self, num_new: jax.Array) -> KVCacheLike: ...

    def advance(self, num_new: jax.Array) -> KVCacheLike: ...

    def update(self, layer: jax.Array | int, k: jax.Array, v: jax.Array) -> KVCacheLike: ...

    def attend(
        self,
        layer: jax.Array | int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        sinks: jax.Array | None = None,
        impl: str = "auto",
    ) -> jax.Array: ...


class Attention(eqx.Module):
    """Causal GQA self-attention: ``q/k/v_proj`` -> (optional q/k RMSNorm) -> RoPE ->
    ``edl.ops.attention`` -> ``o_proj``.

    ``q_norm``/``k_norm`` (Qwen3, Gemma 3) normalise each head over ``head_dim`` before
    RoPE; with ``qk_norm_over_heads`` (OLMo 2) one norm covers all heads' features at once
    (``heads * head_dim`` for q, ``kv_heads * head_dim`` for k). RoPE tables of ``None``
    leave q and k unrotated (SmolLM3's NoPE layers). With ``fused_qkv`` (Phi-3) one
    ``qkv_proj`` of ``(heads + 2 * kv_heads) * head_dim`` outputs, q then k then v, replaces
    the three (``q/k/v_proj`` are ``None``). ``sinks`` (GPT-OSS) holds one learned logit
    per query head that joins every row's softmax denominator (``edl.ops.attention``).
    """

    q_proj: Linear | None
    k_proj: Linear | None
    v_proj: Linear | None
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qkv_proj: Linear | None = None
    qk_norm_over_heads: bool = eqx.field(static=True, default=False)
    sinks: Float[Array, " heads"] | None = None

    @classmethod
    def init(
        cls,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        qk_norm_over_heads: bool = False,
        fused_qkv: bool = False,
        sinks: bool = False,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> Attention:
        """``qk_norm_eps`` not None adds q/k RMSNorms with that epsilon and ``qk_norm_offset``
        (Gemma 3's ``1 + w``): per head (Qwen3), or ``qk_norm_over_heads`` over all heads
        (OLMo 2); ``fused_qkv`` keeps q, k and v as one ``qkv_proj`` (Phi-3's layout);
        ``sinks`` adds per-head attention sinks, normal(0, ``std``) as HF initialises them."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        kq, kk, kv, ko, ks = jax.random.split(key, 5)
        lin = {"std": std, "dtype": dtype}
        q_norm = k_norm = None
        if qk_norm_eps is not None:
            q_dim, k_dim = (
                (num_heads * head_dim, num_kv_heads * head_dim)
                if qk_norm_over_heads
                else (head_dim, head_dim)
            )
            norm = lambda d: RMSNorm.init(d, eps=qk_norm_eps, offset=qk_norm_offset, dtype=dtype)
            q_norm, k_norm = norm(q_dim), norm(k_dim)
        widths = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        o_proj = Linear.init(num_heads * head_dim, dim, use_bias=o_bias, key=ko, **lin)
        sizes = {
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "qk_norm_over_heads": qk_norm_over_heads,
            "sinks": std * jax.random.normal(ks, (num_heads,), dtype) if sinks else None,
        }
        if fused_qkv:
            qkv = Linear.init(dim, sum(widths), use_bias=qkv_bias, key=kq, **lin)
            return cls(None, None, None, o_proj, q_norm, k_norm, **sizes, qkv_proj=qkv)
        q, k, v = (
            Linear.init(dim, w, use_bias=qkv_bias, key=kw, **lin)
            for w, kw in zip(widths, (kq, kk, kv), strict=True)
        )
        return cls(q, k, v, o_proj, q_norm, k_norm, **sizes)

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        cos: Float[Array, "batch seq rope_dim"] | None,
        sin: Float[Array, "batch seq rope_dim"] | None,
        segment_ids: SegmentIds | BidirectionalBlocks | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        """``window`` (Mistral's left sliding window), ``softcap`` (Gemma 2's logit
        soft-capping), ``scale`` (default ``head_dim ** -0.5``) and ``impl`` are as in
        ``edl.ops.attention``; they are call arguments so that layers of one stack may differ
        in them."""
        b, s, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        out = attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=segment_ids,
            window=window,
            softcap=softcap,
            scale=scale,
            sinks=self.sinks,
            impl=impl,
        )
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))

    def decode(
        self,
        x: Float[Array, "batch seq dim"],
        cos: Float[Array, "batch seq rope_dim"] | None,
        sin: Float[Array, "batch seq rope_dim"] | None,
        cache: KVCacheLike,
        layer: Int[Array, ""] | int,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        impl: str = "auto",
    ) -> tuple[Float[Array, "batch seq dim"], KVCacheLike]:
        """Attention of new tokens through a KV cache: their keys/values are written into
        ``cache`` at ``layer``, then they attend to everything cached. Returns the output
        and the updated cache."""
        b, s, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        cache = cache.update(layer, k, v)
        options = dict(window=window, softcap=softcap, scale=scale, impl=impl)
        if self.sinks is not None:  # only then: other caches need not know the argument
            options["sinks"] = self.sinks
        out = cache.attend(layer, q, k, v, **options)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim)), cache

    def _project(self, x, cos, sin):
        """q ``(b, s, heads, d)`` and k/v ``(b, s, kv_heads, d)``, normed and rotated
        (``cos`` / ``sin`` ``None``: not rotated)."""
        b, s, _ = x.shape
        if self.qkv_proj is not None:
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = jnp.split(self.qkv_proj(x), [q_width, q_width + kv_width], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        norms = self.q_norm is not None and self.k_norm is not None
        if norms and self.qk_norm_over_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if norms and not self.qk_norm_over_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is None or sin is None:
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
