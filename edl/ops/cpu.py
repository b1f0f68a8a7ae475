"""XLA:CPU lowerings: the forms of ``edl.ops`` maths that XLA:CPU runs faster, or compiles so
that a zero LoRA update changes no bit.

Each function computes what the plain form in its caller computes (up to summation order,
where said); the caller keeps the plain form as its definition and picks the form here at
one place, only when lowering for CPU (``jax.lax.platform_dependent`` keeps only the branch
of the platform being lowered for):

- ``weight_left``: ``x @ W.T`` at few rows as ``(W @ x.T).T`` (``edl.ops.matmul``, at
  ``SMALL_ROWS`` rows or fewer).
- ``add_unless_zero``: a LoRA update added to a product as a conditional (``edl.ops.matmul``).
- ``live_lengths`` / ``read_live``: a decode step reads only the live prefix of a cache
  (``edl.ops.cached_attention``, ``"xla"``).
- ``one_token_attention``: one new token per row attends to the cache as it lies
  (``edl.ops.cached_attention``, ``"xla"``).

Measurements are in ``benchmarks/RESULTS.md``, sections "linear: few-row GEMMs on CPU",
"serve: unstacked decoding without weight copies", "generate: a decode step's attention reads the
cache in place" and "generate: a decode step reads only the live part of the cache".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int

from edl.ops.attention import masked_softmax
from edl.platforms import platform_dependent

__all__ = [
    "LIVE_BRANCHES",
    "add_unless_zero",
    "live_lengths",
    "one_token_attention",
    "read_live",
    "weight_left",
]

# -- products ---------------------------------------------------------------------------------


@jax.custom_jvp
def _add_skipping_zeros(y: jax.Array, addend: jax.Array) -> jax.Array:
    return jax.lax.cond(jnp.any(addend != 0), jnp.add, lambda y, _: y, y, addend)


@_add_skipping_zeros.defjvp
def _add_skipping_zeros_jvp(primals, tangents):
    # Derivatives are those of ``y + addend`` either way: a zero LoRA update (B = 0) still
    # passes its gradient on to B.
    (y, addend), (dy, daddend) = primals, tangents
    return _add_skipping_zeros(y, addend), dy + daddend


def add_unless_zero(y: jax.Array, addend: jax.Array | None) -> jax.Array:
    """``y + addend`` (``y`` when None); lowered for CPU, ``y`` itself where ``addend`` is all
    zeros.

    XLA:CPU compiles a fused computation differently when one more term is fused into it (the
    summation order of a reduction such as an RMS norm, or which multiply-add becomes an FMA,
    changes), so even an all-zero LoRA update added after a product moved its consumers'
    results by an ulp. A conditional is a fusion boundary XLA:CPU keeps (unlike
    ``optimization_barrier``, gone before fusion there): an all-zero addend hands on ``y``
    itself, and ``y``'s consumers compile and compute exactly as without an addend.
    """
    if addend is None:
        return y
    return platform_dependent(y, addend, cpu=_add_skipping_zeros, default=jnp.add)


def weight_left(
    x: Float[Array, "*batch in"],
    weight: Float[Array, "out in"],
    addend: Float[Array, "*batch out"] | None = None,
) -> Float[Array, "*batch out"]:
    """``x @ weight.T + addend`` computed as ``(weight @ x.T).T``.

    XLA:CPU's GEMM for ``x @ W.T`` costs far more than its arithmetic when ``x`` has only a
    few rows, as in the projections of a decode step; with the weight as the left operand
    (the small result transposed back) most of that cost goes. A matrix-vector product (one
    row) gains nothing, and from a few hundred rows on it is slower.
    """
    # The barrier keeps XLA from canonicalising the dot back to ``x @ W.T`` (the layout the
    # slow path has): the product is materialised as (out, *batch), then transposed.
    y = jax.lax.optimization_barrier(jnp.einsum("oi,...i->o...", weight, x))
    y = add_unless_zero(y, None if addend is None else jnp.moveaxis(addend, -1, 0))
    return jnp.moveaxis(y, 0, -1)


# -- reading a KV cache -----------------------------------------------------------------------

LIVE_BRANCHES = 16  # at most this many static read lengths per cache (one compiled branch each)


def live_lengths(cache_len: int, multiple: int = 16) -> tuple[int, ...]:
    """The static prefix lengths a cache of ``cache_len`` positions is read at on CPU:
    multiples of one block (itself a multiple of ``multiple``), at most ``LIVE_BRANCHES`` of
    them, ending with ``cache_len``. A read wastes less than one block, ``cache_len / 16`` at
    most: ``live_lengths(160) == (16, 32, ..., 160)``, ``live_lengths(4096) == (256, ...,
    4096)``."""
    block = multiple * -(-cache_len // (multiple * LIVE_BRANCHES))
    return (*range(block, cache_len, block), cache_len)


def read_live(
    read: Callable[[int], jax.Array], bound: Int[Array, ""], sizes: tuple[int, ...]
) -> jax.Array:
    """``read(size)`` for the smallest of ``sizes`` holding ``bound`` (past the last, the
    last), one ``lax.switch`` branch per size: a decode step reads only the live prefix of
    its cache instead of all of it. On GPU a data-dependent branch costs a host round trip,
    and the Pallas kernels skip blocks past each row's length already."""
    index = jnp.searchsorted(jnp.asarray(sizes, bound.dtype), bound)
    branches = [functools.partial(read, size) for size in sizes]
    return jax.lax.switch(jnp.minimum(index, len(sizes) - 1), branches)


def one_token_attention(
    q: Float[Array, "batch 1 heads head_dim"],
    k: Float[Array, "batch cache_len kv_heads head_dim"],
    v: Float[Array, "batch cache_len kv_heads head_dim"],
    mask: Bool[Array, "batch 1 cache_len"],
    *,
    softcap: float | None,
    scale: float,
) -> Float[Array, "batch 1 heads head_dim"]:
    """``masked_attention`` for one new token per row, reading the cache as it lies.

    XLA:CPU runs a batched dot with its batch dimensions leading, so the grouped einsum of
    ``masked_attention`` first copies the cache from ``(batch, len, kv_heads, head_dim)`` into
    ``(batch, kv_heads, len, head_dim)``, for K and for V, every decode step. Here each row's
    cache is one ``(len, kv_heads * head_dim)`` matrix and the row's query a block-diagonal
    ``(kv_heads * head_dim, heads)`` matrix (each head's query in its kv head's block, zeros
    elsewhere): ``kv_heads`` times the multiply-adds, on arrays a few KiB per row, and no copy.
    The outputs are the diagonal blocks of ``probs @ V`` taken the same way.
    """
    kv_heads = k.shape[2]
    same = jnp.eye(kv_heads, dtype=jnp.bool_)[:, None, :, None]  # (kv_heads, 1, kv_heads, 1)
    # q_block[b, (h, d), (j, g)] = q[b, 0, (j, g), d] if h == j else 0
    q_t = rearrange(q, "b 1 (j g) d -> b 1 d j g", j=kv_heads)
    q_block = jnp.where(same[None], q_t, jnp.zeros((), q.dtype))  # (b, h, d, j, g)
    q_block = rearrange(q_block, "b h d j g -> b (h d) (j g)")
    k_rows, v_rows = (rearrange(x, "b t h d -> b t (h d)") for x in (k, v))
    logits = jnp.einsum("btc,bcn->btn", k_rows, q_block, preferred_element_type=jnp.float32)
    logits = logits * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    probs = masked_softmax(logits, mask[:, 0, :, None], axis=1)  # (b, len, heads)
    probs = probs.astype(v.dtype)
    out = jnp.einsum("btn,btc->bnc", probs, v_rows, preferred_element_type=jnp.float32)
    out = rearrange(out, "b (j g) (h d) -> b j g h d", j=kv_heads, h=kv_heads)  # keep h == j
    out = jnp.sum(jnp.where(same[None], out, 0.0), axis=3)
    return rearrange(out, "b j g d -> b 1 (j g) d").astype(q.dtype)
