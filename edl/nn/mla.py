"""Multi-head latent attention (DeepSeek-V2 / V3), HF's ``DeepseekV3Attention`` layout.

``q``: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` when
``q_lora_rank`` is None), each head ``[q_nope, q_rope]``. ``kv_a_proj_with_mqa`` gives the
latent (``kv_lora_rank``, normalised by ``kv_a_layernorm``) and the shared RoPE key
(``qk_rope_head_dim``); ``kv_b_proj`` expands the latent into per-head ``k_nope`` and ``v``.
The maths and the two forms (materialised, absorbed) are in ``edl.ops.mla``.

The forward pass (training, a whole prompt) materialises per-head K / V. Through a cache,
``decode`` keeps the compressed form: a *latent* cache (``edl.generate.init_cache`` of an
MLA config: one KV head of ``kv_lora_rank + qk_rope_head_dim`` features; the paged cache
likewise) stores ``[latent, k_rope]`` per token, and the new queries attend to it absorbed
(MQA over the latents); a fresh cache's prompt (prefill) still attends materialised. A
cache of per-head keys / values (``heads`` KV heads of the q/k head dim: the materialised
form, for comparison) is read as ordinary attention.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.nn.attention import KVCacheLike
from edl.nn.layers import Linear, RMSNorm
from edl.ops.attention import SegmentIds
from edl.ops.mla import absorb_query, expand_output, mla_attention, rotate, split_kv_b

__all__ = ["MultiHeadLatentAttention"]

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps


class MultiHeadLatentAttention(eqx.Module):
    """MLA (module docstring); sizes as HF names them."""

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_layernorm: RMSNorm | None
    q_b_proj: Linear | None
    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: RMSNorm
    kv_b_proj: Linear
    o_proj: Linear
    num_heads: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    rope_interleave: bool = eqx.field(static=True, default=True)

    @classmethod
    def init(
        cls,
        dim: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool = False,
        rope_interleave: bool = True,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> MultiHeadLatentAttention:
        """``bias``: HF's ``attention_bias`` (on ``q_a_proj``, ``kv_a_proj_with_mqa`` and
        ``o_proj``)."""
        keys = iter(jax.random.split(key, 6))
        lin = lambda i, o, b=False: Linear.init(
            i, o, use_bias=b, std=std, dtype=dtype, key=next(keys)
        )
        norm = lambda d: RMSNorm.init(d, eps=LATENT_NORM_EPS, dtype=dtype)
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            q = (lin(dim, num_heads * qk), None, None, None)
        else:
            q = (
                None,
                lin(dim, q_lora_rank, bias),
                norm(q_lora_rank),
                lin(q_lora_rank, num_heads * qk),
            )
        return cls(
            *q,
            lin(dim, kv_lora_rank + qk_rope_head_dim, bias),
            norm(kv_lora_rank),
            lin(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)),
            lin(num_heads * v_head_dim, dim, bias),
            num_heads=num_heads,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            kv_lora_rank=kv_lora_rank,
            rope_interleave=rope_interleave,
        )

    @property
    def latent_dim(self) -> int:
        """Features a latent cache holds per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        cos: Float[Array, "batch seq rope_dim"] | None,
        sin: Float[Array, "batch seq rope_dim"] | None,
        segment_ids: SegmentIds | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        """Materialised MLA over ``x`` (``edl.ops.mla.mla_attention``); arguments as
        ``edl.nn.Attention``'s (``softcap`` must be None: MLA has none)."""
        _no_softcap(softcap)
        q, latent = self._project(x, cos, sin)
        k, v = self._expand(latent)
        out = mla_attention(q, k, v, segment_ids=segment_ids, window=window, scale=scale, impl=impl)
        return self._out(out)

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
        """New tokens through ``cache`` (module docstring): a latent cache gets the new
        ``[latent, k_rope]`` and is read absorbed; a per-head cache gets materialised K /
        V (values zero-padded to the q/k head dim)."""
        _no_softcap(softcap)
        q, latent = self._project(x, cos, sin)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        scale = qk**-0.5 if scale is None else scale
        options = dict(window=window, scale=scale, impl=impl)
        if _cache_heads(cache) == 1:
            return self._decode_latent(q, latent, cache, layer, options)
        k, v = self._expand(latent)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk - self.v_head_dim)))
        cache = cache.update(layer, k, v)
        out = cache.attend(layer, q, k, v, **options)[..., : self.v_head_dim]
        return self._out(out), cache

    def _decode_latent(self, q, latent, cache, layer, options):
        """Absorbed attention over a latent cache: keys and values are the cached
        ``[latent, k_rope]`` (values: its first ``kv_lora_rank`` features). A fresh cache's
        prompt (prefill) attends materialised, as the forward pass does."""
        w_k, w_v = split_kv_b(
            self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        )
        cache = cache.update(layer, latent, latent)
        if getattr(cache, "fresh", False):
            # A whole prompt: its new tokens attend only to each other, materialised (heads
            # of qk_nope + qk_rope, which the flash kernels take) rather than over latents.
            k, v = self._expand(latent)
            return self._out(mla_attention(q, k, v, **options)), cache
        q_nope, q_rope = jnp.split(q, [self.qk_nope_head_dim], axis=-1)
        q_lat = jnp.concatenate([absorb_query(q_nope, w_k), q_rope], axis=-1)
        attended = cache.attend(layer, q_lat, latent, latent, **options)
        out = expand_output(attended[..., : self.kv_lora_rank], w_v)
        return self._out(out), cache

    def _project(self, x, cos, sin):
        """Rotated queries ``(b, s, heads, nope + rope)`` and the new tokens' cache entry
        ``[normed latent, rotated k_rope]`` ``(b, s, 1, kv_lora_rank + rope)``."""
        b, s, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, s, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = jnp.split(q, [self.qk_nope_head_dim], axis=-1)
        q_rope = rotate(q_rope, cos, sin, interleave=self.rope_interleave)
        c, k_rope = jnp.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_rope = rotate(k_rope[:, :, None], cos, sin, interleave=self.rope_interleave)
        latent = jnp.concatenate([self.kv_a_layernorm(c)[:, :, None], k_rope], axis=-1)
        return jnp.concatenate([q_nope, q_rope], axis=-1), latent

    def _expand(self, latent):
        """Per-head keys ``(b, s, heads, nope + rope)`` and values ``(b, s, heads, v)``."""
        b, s = latent.shape[:2]
        c, k_rope = jnp.split(latent[:, :, 0], [self.kv_lora_rank], axis=-1)
        kv = self.kv_b_proj(c).reshape(
            b, s, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = jnp.split(kv, [self.qk_nope_head_dim], axis=-1)
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (b, s, self.num_heads, self.qk_rope_head_dim))
        return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v

    def _out(self, out):
        b, s = out.shape[:2]
        return self.o_proj(out.reshape(b, s, self.num_heads * self.v_head_dim))


def _no_softcap(softcap: float | None) -> None:
    if softcap is not None:
        raise ValueError(f"multi-head latent attention has no logit soft-capping, got {softcap}")


def _cache_heads(cache: KVCacheLike) -> int:
    """The KV heads a cache stores (its arrays' second-to-last axis): 1 for a latent cache."""
    leaves = [x for x in jax.tree.leaves(cache) if getattr(x, "ndim", 0) == 5]
    if not leaves:
        raise TypeError(f"MLA decode: {type(cache).__name__} holds no (…, kv_heads, dim) arrays")
    return leaves[0].shape[-2]
