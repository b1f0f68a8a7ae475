"""Qwen3-Next's hybrid decoder: its layer, the trunk's stacks and the cache it decodes with.

Each layer mixes tokens with Gated DeltaNet (``linear_attn``, ``edl.nn.gated_deltanet``) or
gated full attention (``self_attn``, ``edl.nn.gated_blocks.GatedAttention``), as
``layer_types`` says, then runs a dense MLP or the shared-expert MoE. Layers of each
(mixer, MLP) kind share a stack: ``model.layers`` (linear attention), ``model.attn_layers``
(full attention) and, when dense and MoE layers mix, ``model.dense_layers`` /
``model.dense_attn_layers``; the usual pattern (three linear layers, then a full one) runs as
one scan over periods of four layers, so compile time stays flat in depth.

Generation keeps, besides the keys / values of the full-attention layers (a contiguous
``KVCache`` or a ``PagedKVCache`` whose layer axis holds the full layers only), each linear
layer's conv and delta-rule states per row (``RecurrentStateCache``). The trunk says so
(``RECURRENT_STATE``) and gives zero states (``init_states``); the serving engine keeps one
state slot per running request (``edl.serve.state_slots``) and hands each call its rows'
states through ``wrap_cache(kv, states)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.config import DecoderConfig
from edl.models.decoder import PARTITION_RULES, DecoderLayer, DecoderModel
from edl.module import require_float_dtype
from edl.nn.gated_blocks import GatedAttention, SharedExpertMoE
from edl.nn.gated_deltanet import GatedDeltaNet
from edl.nn.layers import Embedding, RMSNorm
from edl.nn.mlp import GatedMLP
from edl.nn.moe import SparseMoE
from edl.nn.stack import stack, unstack
from edl.ops.moe import RouterStats

__all__ = ["Qwen3NextDecoderLayer", "Qwen3NextTrunk", "RecurrentStateCache"]

# The linear-attention projections split like q/k/v (outputs over tp) and o (inputs over tp);
# the conv, A_log, dt_bias and the gated norm are small and replicated.
_BASE = r"(\.base_layer)?"
QWEN3_NEXT_RULES = (
    (rf"(in_proj_qkvz|in_proj_ba){_BASE}\.weight$", P(None, "tp", "fsdp")),
    (rf"out_proj{_BASE}\.weight$", P(None, "fsdp", "tp")),
    *PARTITION_RULES,
)

LINEAR, FULL = "linear_attention", "full_attention"


def _norm(config: DecoderConfig, dim: int, dtype: DTypeLike) -> RMSNorm:
    return RMSNorm.init(dim, eps=config.rms_norm_eps, offset=1.0, dtype=dtype)


class Qwen3NextDecoderLayer(DecoderLayer):
    """``h += mixer(norm(h)); h += mlp(norm(h))``; the mixer is ``linear_attn`` or
    ``self_attn`` (the other is ``None``). A ``DecoderLayer`` (pre-norms only) so that the
    trunk's layer loop runs it."""

    self_attn: GatedAttention | None
    mlp: GatedMLP | SharedExpertMoE
    linear_attn: GatedDeltaNet | None = None

    @classmethod
    def init(
        cls, config: Any, *, mixer: str, mlp: str, dtype: DTypeLike, key: PRNGKeyArray
    ) -> Qwen3NextDecoderLayer:
        c = config
        k_mix, k_mlp = jax.random.split(key)
        std, d = c.initializer_range, c.hidden_size
        linear = attn = None
        if mixer == LINEAR:
            linear = GatedDeltaNet.init(
                d,
                num_k_heads=c.linear_num_key_heads,
                num_v_heads=c.linear_num_value_heads,
                head_k_dim=c.linear_key_head_dim,
                head_v_dim=c.linear_value_head_dim,
                conv_kernel=c.linear_conv_kernel_dim,
                eps=c.rms_norm_eps,
                std=std,
                dtype=dtype,
                key=k_mix,
            )
        else:
            attn = GatedAttention.init_gated(
                d,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                bias=c.qkv_bias,
                qk_norm_eps=c.rms_norm_eps,
                std=std,
                dtype=dtype,
                key=k_mix,
            )
        if mlp == "moe":
            block = SharedExpertMoE.init_shared(
                d,
                c.expert_intermediate_size,
                c.shared_expert_intermediate_size,
                c.num_experts,
                c.num_experts_per_tok,
                normalize=c.norm_topk_prob,
                act=c.hidden_act,
                std=std,
                dtype=dtype,
                key=k_mlp,
            )
        else:
            block = GatedMLP.init(
                d, c.intermediate_size, act=c.hidden_act, std=std, dtype=dtype, key=k_mlp
            )
        return cls(
            self_attn=attn,
            mlp=block,
            input_layernorm=_norm(c, d, dtype),
            post_attention_layernorm=_norm(c, d, dtype),
            pre_feedforward_layernorm=None,
            post_feedforward_layernorm=None,
            linear_attn=linear,
        )

    def __call__(
        self,
        h: Float[Array, "batch seq dim"],
        cos: jax.Array | None,
        sin: jax.Array | None,
        segment_ids: Any,
        *,
        config: DecoderConfig,
        window: int | None = None,
        token_mask: Float[Array, "batch seq"] | None = None,
    ) -> tuple[jax.Array, RouterStats | None]:
        """``DecoderLayer``'s call: the block and its router statistics. ``segment_ids``:
        attention's ``(q_ids, kv_ids)`` (``edl.ops.attention.padding_segments``); a linear
        layer restarts its states where ``q_ids`` changes (packed sequences)."""
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            segments = None if segment_ids is None else segment_ids[0]
            y = self.linear_attn(x, token_mask, segments=segments)
        else:
            y = self.self_attn(
                x, cos, sin, segment_ids, window=window, impl=config.run.attention_impl
            )
        return self._mlp(h + y.astype(h.dtype), config, token_mask)

    def decode(
        self,
        h: Float[Array, "batch seq dim"],
        cos: jax.Array | None,
        sin: jax.Array | None,
        cache: RecurrentStateCache,
        layer: Int[Array, ""] | int,
        *,
        config: DecoderConfig,
        window: int | None = None,
    ) -> tuple[jax.Array, RecurrentStateCache]:
        """The block on new tokens through the cache: a linear layer continues its conv
        and delta states, a full layer attends through the KV cache."""
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            i = cache.slot(cache.linear_slots, layer)
            y, conv, delta = self.linear_attn.decode(
                x, cache.conv[i], cache.delta[i], cache.new_mask(x.shape[1])
            )
            cache = dataclasses.replace(
                cache,
                conv=cache.conv.at[i].set(conv.astype(cache.conv.dtype)),
                delta=cache.delta.at[i].set(delta.astype(cache.delta.dtype)),
            )
        else:
            i = cache.slot(cache.full_slots, layer)
            y, kv = self.self_attn.decode(
                x, cos, sin, cache.kv, i, window=window, impl=config.run.attention_impl
            )
            cache = dataclasses.replace(cache, kv=kv)
        return self._mlp(h + y.astype(h.dtype), config, None)[0], cache

    def _mlp(self, h, config, token_mask):
        x = self.post_attention_layernorm(h)
        stats = None
        if isinstance(self.mlp, SparseMoE):
            y, stats = self.mlp(
                x,
                token_mask,
                impl=config.run.moe_impl,
                capacity_factor=config.run.moe_capacity_factor,
            )
        else:
            y = self.mlp(x)
        return h + y.astype(h.dtype), stats


class RecurrentStateCache(eqx.Module):
    """A KV cache for the full-attention layers (``kv``: one slot per full layer) and each
    linear layer's states per row: ``conv`` ``(linear_layers, batch, kernel - 1, channels)``
    and ``delta`` ``(linear_layers, batch, v_heads, dk, dv)`` (float32 at least).
    ``num_new``: each row's valid new tokens in the running call (set by ``reserve``)."""

    kv: Any
    conv: jax.Array
    delta: jax.Array
    num_new: jax.Array
    linear_slots: tuple[int, ...] = eqx.field(static=True)
    full_slots: tuple[int, ...] = eqx.field(static=True)

    @property
    def lengths(self) -> jax.Array:
        return self.kv.lengths

    @property
    def states(self) -> tuple[jax.Array, jax.Array]:
        """``(conv, delta)``: the recurrent states, as ``Qwen3NextTrunk.wrap_cache`` takes
        them."""
        return self.conv, self.delta

    @property
    def fresh(self) -> bool:
        return self.kv.fresh

    @property
    def cache_len(self) -> int:
        return self.kv.cache_len

    @staticmethod
    def slot(slots: tuple[int, ...], layer: Int[Array, ""] | int) -> jax.Array:
        """Layer ``layer``'s index among the layers of its kind (``-1``: not of it)."""
        return jnp.asarray(slots, jnp.int32)[layer]

    def new_mask(self, seq: int) -> jax.Array:
        return (jnp.arange(seq, dtype=jnp.int32)[None] < self.num_new[:, None]).astype(jnp.float32)

    def reserve(self, num_new: jax.Array) -> RecurrentStateCache:
        return dataclasses.replace(self, kv=self.kv.reserve(num_new), num_new=num_new)

    def advance(self, num_new: jax.Array) -> RecurrentStateCache:
        return dataclasses.replace(self, kv=self.kv.advance(num_new))

    def update(self, layer: Int[Array, ""] | int, k: jax.Array, v: jax.Array) -> Any:
        """``kv.update`` (``layer``: a full-attention slot); the KV-cache interface."""
        return dataclasses.replace(self, kv=self.kv.update(layer, k, v))

    def attend(self, layer: Int[Array, ""] | int, q, k, v, **options: Any) -> jax.Array:
        """``kv.attend`` (``layer``: a full-attention slot); the KV-cache interface."""
        return self.kv.attend(layer, q, k, v, **options)

    def select_rows(self, rows: Int[Array, " new_batch"]) -> RecurrentStateCache:
        """The cache of rows ``rows`` (beam search), states included."""
        return dataclasses.replace(
            self,
            kv=self.kv.select_rows(rows),
            conv=jnp.take(self.conv, rows, axis=1),
            delta=jnp.take(self.delta, rows, axis=1),
            num_new=jnp.take(self.num_new, rows, axis=0),
        )


def _slots(kinds: tuple[str, ...], kind: str) -> tuple[int, ...]:
    return tuple(kinds[:i].count(kind) if k == kind else -1 for i, k in enumerate(kinds))


class Qwen3NextTrunk(DecoderModel):
    """The Qwen3-Next decoder trunk: ``DecoderModel`` with stacks per (mixer, MLP) kind."""

    partition_rules: ClassVar = QWEN3_NEXT_RULES
    # The trunk's model call keeps recurrent states (edl.generate.steps.new_cache asks).
    RECURRENT_STATE: ClassVar[bool] = True

    attn_layers: Any = None
    dense_attn_layers: Any = None

    @classmethod
    def init(
        cls, config: DecoderConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> Qwen3NextTrunk:
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_embed, k_layers = jax.random.split(key)
        keys = jax.random.split(k_layers, config.num_hidden_layers)
        stacks = {}
        for group in dict.fromkeys(config.layer_groups):
            mine = [i for i, g in enumerate(config.layer_groups) if g == group]
            mixer, mlp = config.layer_types[mine[0]], config.layer_mlps[mine[0]]

            def make(k, mixer=mixer, mlp=mlp):
                return Qwen3NextDecoderLayer.init(config, mixer=mixer, mlp=mlp, dtype=dtype, key=k)

            stacks[group] = stack(make, keys[jnp.asarray(mine)])
        embed = Embedding.init(
            config.vocab_size,
            config.hidden_size,
            std=config.initializer_range,
            dtype=dtype,
            key=k_embed,
        )
        return cls(
            embed_tokens=embed,
            layers=stacks.get("layers"),
            dense_layers=stacks.get("dense_layers"),
            norm=_norm(config, config.hidden_size, dtype),
            config=config,
            attn_layers=stacks.get("attn_layers"),
            dense_attn_layers=stacks.get("dense_attn_layers"),
        )

    def _groups(self) -> dict[str, Any]:
        names = ("layers", "dense_layers", "attn_layers", "dense_attn_layers")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def unstacked(self) -> Qwen3NextTrunk:
        return dataclasses.replace(self, **{n: unstack(s) for n, s in self._groups().items()})

    def _stacks(self):
        return self._groups(), self.config.layer_groups

    def init_states(self, rows: int) -> tuple[jax.Array, jax.Array]:
        """Zero recurrent states of ``rows`` rows: each linear layer's conv tail ``(linear_
        layers, rows, kernel - 1, channels)`` in the model's dtype and delta-rule state
        ``(linear_layers, rows, v_heads, dk, dv)`` in float32 at least (as the delta rule
        computes). Every leaf has its rows on axis 1 (``edl.serve.state_slots`` keeps one
        slot per running request along it)."""
        c = self.config
        lin = tuple(c.layer_types).count(LINEAR)
        dtype = self.embed_tokens.weight.dtype
        channels = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )
        delta = (lin, rows, c.linear_num_value_heads, c.linear_key_head_dim)
        conv = (lin, rows, c.linear_conv_kernel_dim - 1, channels)
        wide = jnp.promote_types(dtype, jnp.float32)
        return jnp.zeros(conv, dtype), jnp.zeros((*delta, c.linear_value_head_dim), wide)

    def wrap_cache(
        self, kv: Any, states: tuple[jax.Array, jax.Array] | None = None
    ) -> RecurrentStateCache:
        """``kv`` (the full layers' cache from ``init_cache`` or ``init_paged_cache``; its
        layer axis holds the full layers only) with the linear layers' states of its rows:
        ``states`` (as ``init_states`` gives them; ``RecurrentStateCache.states`` reads them
        back after a call) or zeros."""
        batch = kv.lengths.shape[0]
        conv, delta = self.init_states(batch) if states is None else states
        kinds = tuple(self.config.layer_types)
        return RecurrentStateCache(
            kv,
            conv,
            delta,
            jnp.zeros((batch,), jnp.int32),
            _slots(kinds, LINEAR),
            _slots(kinds, FULL),
        )
