"""Multi-head latent attention (DeepSeek-V2 / V3) as pure functions.

MLA compresses each token's keys and values into one latent ``c`` (``kv_lora_rank``
features, RMS-normalised) plus one RoPE key ``k_rope`` shared by every head
(``qk_rope_head_dim``). ``kv_b_proj`` expands the latent into each head's un-rotated key
``k_nope = W_k c`` (``qk_nope_head_dim``) and value ``v = W_v c`` (``v_head_dim``); a head's
key is ``[k_nope, k_rope]`` and its query ``[q_nope, q_rope]``.

Two ways to compute the same attention:

- **materialised** (training, prefill): per-head K / V, ``mla_attention`` below. Values are
  narrower than queries / keys (``v_head_dim`` vs ``qk_nope + qk_rope``); the attention
  dispatch (``edl.ops.attention``: the native CPU kernel, Pallas on GPU / TPU, XLA where
  none takes the shapes, warning why) wants one head dim, so ``v`` is zero-padded to the
  query's width and the output cut back: the padded features attend to nothing but zeros.
- **absorbed** (decode from a latent cache): ``q_nope . W_k c = (W_k^T q_nope) . c``, so
  the query absorbs ``W_k`` (``absorb_query``) and attends to the cached ``[c, k_rope]`` as
  one shared KV head (MQA, key dim ``kv_lora_rank + qk_rope_head_dim``); the values are the
  latents themselves (the same cached array: its first ``kv_lora_rank`` features), and
  ``W_v`` is applied to each head's attended latent afterwards (``expand_output``). The
  cache then holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer instead
  of ``heads * (qk_nope + qk_rope + v_head_dim)``.

DeepSeek's checkpoints lay the RoPE features out in interleaved pairs (HF's
``rope_interleave``, ``apply_rotary_pos_emb_interleave``): ``interleaved_rope``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Float

from edl.ops.attention import SegmentIds, attention
from edl.ops.rope import apply_rope

__all__ = [
    "absorb_query",
    "expand_output",
    "interleaved_rope",
    "mla_attention",
    "rotate",
    "split_kv_b",
    "yarn_softmax_mscale",
]


def interleaved_rope(
    x: Float[Array, "batch seq heads dim"],
    cos: Float[Array, "batch seq dim"],
    sin: Float[Array, "batch seq dim"],
) -> Float[Array, "batch seq heads dim"]:
    """HF's ``apply_rotary_pos_emb_interleave``: pairs ``(x0, x1), (x2, x3), ...`` each
    rotated by one frequency, written out de-interleaved (``[even', odd']``), as transformers
    does. At least float32 inside, cast back to ``x.dtype``."""
    half = x.shape[-1] // 2
    dtype = x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.float32  # float64 stays
    c, s = (t[:, :, None, :half].astype(dtype) for t in (cos, sin))
    xf = x.astype(dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rotate(
    x: Float[Array, "batch seq heads dim"],
    cos: Float[Array, "batch seq dim"] | None,
    sin: Float[Array, "batch seq dim"] | None,
    *,
    interleave: bool,
) -> Float[Array, "batch seq heads dim"]:
    """RoPE on ``x`` (all of its features): interleaved pairs or HF's rotate-half halves;
    ``cos`` / ``sin`` ``None`` leaves ``x`` as it is."""
    if cos is None or sin is None:
        return x
    return interleaved_rope(x, cos, sin) if interleave else apply_rope(x, cos, sin)


def yarn_softmax_mscale(factor: float, mscale_all_dim: float) -> float:
    """The factor on DeepSeek's softmax scale under YaRN (HF's ``yarn_apply_mscale``):
    ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``, 1 for ``factor <= 1`` or no
    ``mscale_all_dim``."""
    if not mscale_all_dim or factor <= 1:
        return 1.0
    m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return m * m


def mla_attention(
    q: Float[Array, "batch q_len heads qk_dim"],
    k: Float[Array, "batch kv_len heads qk_dim"],
    v: Float[Array, "batch kv_len heads v_dim"],
    *,
    segment_ids: SegmentIds | None = None,
    window: int | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "batch q_len heads v_dim"]:
    """Causal attention whose values are narrower than its keys (materialised MLA):
    ``v`` zero-padded to ``qk_dim`` through ``edl.ops.attention`` (any ``impl``), the
    output cut to ``v_dim``. ``scale`` defaults to ``qk_dim ** -0.5``."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim > qk_dim:
        raise ValueError(f"mla_attention: v_head_dim {v_dim} exceeds the q/k head dim {qk_dim}")
    if v_dim < qk_dim:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - v_dim)))
    scale = qk_dim**-0.5 if scale is None else scale
    out = attention(
        q, k, v, causal=True, segment_ids=segment_ids, window=window, scale=scale, impl=impl
    )
    return out[..., :v_dim]


def absorb_query(
    q_nope: Float[Array, "batch seq heads nope"],
    w_k: Float[Array, "heads nope rank"],
) -> Float[Array, "batch seq heads rank"]:
    """``W_k^T q_nope`` per head: the query that scores latents as ``q_nope`` scores keys."""
    return jnp.einsum("bshn,hnr->bshr", q_nope, w_k.astype(q_nope.dtype))


def expand_output(
    attended: Float[Array, "batch seq heads rank"],
    w_v: Float[Array, "heads v_dim rank"],
) -> Float[Array, "batch seq heads v_dim"]:
    """``W_v`` on each head's attention-weighted latent: the head's attention output."""
    return jnp.einsum("bshr,hvr->bshv", attended, w_v.astype(attended.dtype))


def split_kv_b(
    weight: Float[Array, "out rank"], heads: int, nope: int, v_dim: int
) -> tuple[Float[Array, "heads nope rank"], Float[Array, "heads v_dim rank"]]:
    """``kv_b_proj``'s weight ``(heads * (nope + v_dim), rank)`` (torch layout) as per-head
    ``W_k`` ``(heads, nope, rank)`` and ``W_v`` ``(heads, v_dim, rank)``."""
    w = weight.reshape(heads, nope + v_dim, weight.shape[-1])
    return w[:, :nope], w[:, nope:]
