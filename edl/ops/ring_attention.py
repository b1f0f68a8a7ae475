"""Context parallelism: attention over a sequence sharded on the mesh's ``sp`` axis, by ring
passes of K/V blocks (ring attention, Liu et al. 2023).

Each of the ``n`` devices of the axis holds one block of the queries and one of the keys and
values. In ``n`` steps every device attends its query block to the K/V block it holds, folds
the result into a running online softmax (the flash kernels' ``(max, sum, accumulator)``
recurrence, in float32, float64 for float64 inputs), and passes the K/V block (with its
tokens' positions and segment ids) to the next device on the ring (``lax.ppermute``): no
device ever holds more than two K/V blocks, so a sequence ``n`` times longer than one
device's attention fits. Masks come from the tokens' **global positions**, not their order,
so causal masks, sliding windows and packed segments hold for any layout of the sequence
over the devices. Gradients are jax's autodiff through the ring (the transpose of a
``ppermute`` is the reverse ring); each step is rematerialised, so the backward keeps only
the blocks, not every step's logits.

**Load balance.** With a causal mask and the sequence in order, the device holding the last
block does ``n`` blocks of work and the first one; :func:`zigzag_order` gives the token
order (``2n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i``) in which every
device does the same work. Permute the batch's tokens (and labels) once with it in the data
pipeline and pass ``positions=zigzag_order(...)``: the attention is then exactly the
in-order one, permuted::

    order = zigzag_order(seq_len, mesh.shape["sp"])
    with jax.set_mesh(mesh):
        out = ring_attention(q[:, order], k[:, order], v[:, order], causal=True,
                             positions=jnp.asarray(order))   # == attention(q, k, v)[:, order]

Why our own: jax ships no ring attention; MaxText's and EasyDeL's live inside their model
code and kernels. This one is plain jnp over ``shard_map`` (XLA's matmuls on every
platform); a Pallas kernel per step would save the per-step logits' memory traffic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from edl.ops.sharding import BATCH

__all__ = ["ring_attention", "zigzag_order"]

_NEG = -1e30  # the running max's start: finite, so a block with no visible key adds exp(-inf)=0


def zigzag_order(seq_len: int, shards: int) -> np.ndarray:
    """The token order that balances causal ring attention over ``shards`` devices: the
    sequence cut into ``2 * shards`` equal chunks, device ``i`` holding chunks ``i`` and
    ``2 * shards - 1 - i`` (int32 ``(seq_len,)``: the original position of each slot)."""
    if seq_len % (2 * shards):
        raise ValueError(
            f"zigzag_order: seq_len {seq_len} must be a multiple of 2 * shards ({2 * shards})"
        )
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


def ring_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    causal: bool = False,
    window: int | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    positions: Int[Array, " seq"] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    axis: str = "sp",
) -> Float[Array, "batch seq heads head_dim"]:
    """Self-attention of ``q`` / ``k`` / ``v`` with the sequence sharded over mesh axis
    ``axis`` of the mesh set by ``jax.set_mesh`` (module docstring); the result as
    ``edl.ops.attention.attention`` computes it, in the inputs' layout.

    Args:
        causal, window, softcap, scale: as ``edl.ops.attention.attention`` (``window``
            implies causal); masks compare ``positions``.
        segment_ids: ``(batch, seq)`` packed-sequence ids; a query sees keys of its id.
        positions: each token's position in the sequence (default: ``arange(seq)``, the
            order given); e.g. :func:`zigzag_order`.
        axis: the mesh axis the sequence is split over; its size must divide ``seq``.
    Batch rows stay split over ``dp`` / ``fsdp`` and heads over ``tp`` where those divide
    them (every head group of GQA on one device). Rows with no visible key give 0.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.shape:
        raise ValueError(
            f"ring_attention: needs a mesh with axis {axis!r} (jax.set_mesh), got "
            f"{dict(mesh.shape) if not mesh.empty else 'no mesh'}"
        )
    batch, seq, heads, _ = q.shape
    shards = mesh.shape[axis]
    if seq % shards or k.shape[1] != seq or v.shape[1] != seq:
        raise ValueError(
            f"ring_attention: q / k / v need one sequence length divisible by the {shards} "
            f"devices of {axis!r}, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}"
        )
    positions = jnp.arange(seq, dtype=jnp.int32) if positions is None else positions
    segments = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
    rows = tuple(a for a in BATCH if a in mesh.shape and batch % mesh.shape[a] == 0)
    rows = rows if rows and batch % int(np.prod([mesh.shape[a] for a in rows])) == 0 else ()
    tp = mesh.shape.get("tp", 1)
    head_axis = "tp" if tp > 1 and heads % tp == 0 and k.shape[2] % tp == 0 else None
    tokens = PartitionSpec(rows or None, axis, head_axis, None)
    per_row = PartitionSpec(rows or None, axis)
    body = functools.partial(
        _ring,
        axis=axis,
        shards=shards,
        causal=causal or window is not None,
        window=window,
        softcap=softcap,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
    )
    return jax.shard_map(
        body,
        in_specs=(tokens, tokens, tokens, PartitionSpec(axis), per_row),
        out_specs=tokens,
    )(q, k, v, positions.astype(jnp.int32), segments.astype(jnp.int32))


def _ring(
    q: Array,
    k: Array,
    v: Array,
    positions: Array,
    segments: Array,
    *,
    axis: str,
    shards: int,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> Array:
    """One device's part: its query block against every K/V block in turn."""
    qg = rearrange(q, "b q (kv g) d -> b kv g q d", kv=k.shape[2])
    b, kv, g, lq, _ = qg.shape
    wide = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    running = (
        jnp.full((b, kv, g, lq), _NEG, wide),
        jnp.zeros((b, kv, g, lq), wide),
        jnp.zeros((b, kv, g, lq, v.shape[-1]), wide),
    )
    block = (k, v, positions, segments)
    ring = [(j, (j + 1) % shards) for j in range(shards)]
    step = jax.checkpoint(
        functools.partial(_fold, causal=causal, window=window, softcap=softcap, scale=scale)
    )
    for i in range(shards):
        running = step(running, qg, positions, segments, block)
        if i + 1 < shards:
            block = jax.tree.map(lambda x: jax.lax.ppermute(x, axis, ring), block)
    _, total, acc = running
    out = acc / jnp.where(total == 0, 1.0, total)[..., None]
    return rearrange(out, "b kv g q d -> b q (kv g) d").astype(q.dtype)


def _fold(
    running: tuple[Array, Array, Array],
    qg: Array,
    q_pos: Array,
    q_seg: Array,
    block: tuple[Array, Array, Array, Array],
    *,
    causal: bool,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> tuple[Array, Array, Array]:
    """The online softmax after one more K/V block: ``(max, sum, acc)``."""
    k, v, k_pos, k_seg = block
    wide = running[0].dtype
    logits = jnp.einsum("bhgqd,bkhd->bhgqk", qg, k, preferred_element_type=wide) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    visible = q_seg[:, :, None] == k_seg[:, None, :]  # (b, q, k)
    if causal:
        visible &= (k_pos[None, :] <= q_pos[:, None])[None]
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :] < window)[None]
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    top, total, acc = running
    new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
    keep = jnp.exp(top - new_top)
    probs = jnp.exp(logits - new_top[..., None])
    total = total * keep + jnp.sum(probs, axis=-1)
    update = jnp.einsum("bhgqk,bkhd->bhgqd", probs.astype(v.dtype), v, preferred_element_type=wide)
    return new_top, total, acc * keep[..., None] + update
