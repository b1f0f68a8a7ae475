"""The decoder-only transformer every family runs, and its task heads.

Module tree and field names mirror transformers (``model.embed_tokens``,
``model.layers.self_attn.q_proj``, ``model.layers.mlp.experts.gate_proj``, ``model.norm``,
``lm_head``), except that the decoder layers are one stacked module whose arrays carry a
leading layer axis, so ``"model.layers.mlp.up_proj.weight"`` is ``(num_layers, intermediate,
dim)``. A model mixing dense and MoE layers (Qwen3-MoE's ``mlp_only_layers``) keeps its
dense layers in a second stack, ``model.dense_layers``.

What differs between families is configuration (``edl.models.config.DecoderConfig``):
biases, q/k norms, sliding windows per layer, Gemma's norm offset, embedding scale, sandwich
norms and soft-capping, and MoE MLPs. Each family names its classes after HF's
(``LlamaForCausalLM``, ``GemmaForCausalLM``, ...) as thin subclasses of the trunk here and
the task heads of ``edl.models.heads``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.config import DecoderConfig
from edl.module import require_float_dtype
from edl.nn.attention import Attention, KVCacheLike
from edl.nn.gpt_oss_moe import GptOssMoE
from edl.nn.layers import Embedding, RMSNorm
from edl.nn.mlp import GatedMLP
from edl.nn.moe import SparseMoE
from edl.nn.stack import run_stack, stack, unstack
from edl.ops.attention import padding_segments
from edl.ops.block_attention import BidirectionalBlocks
from edl.ops.checks import check_ids
from edl.ops.moe import RouterStats
from edl.ops.rope import rope_tables
from edl.ops.sharding import BATCH, Rules, constrain

__all__ = [
    "PARTITION_RULES",
    "CausalLMOutput",
    "DecoderLayer",
    "DecoderModel",
    "ModelOutput",
    "SequenceClassifierOutput",
]

# Tensor-parallel column splits (q/k/v, gate/up: output features over tp) and row splits
# (o, down: input features over tp), FSDP over the other dimension; the stacked layer axis is
# never split. Experts are split over fsdp (expert parallelism across the data axis) and
# their MLP width over tp. The base weights of LoRA-wrapped layers (``base_layer``) split
# like plain ones; quantized weights (``qweight`` blocks of the flattened matrix, one scale
# per block) split their blocks over fsdp. Norms, routers, LoRA adapters (rank-sized) and
# the classification head are replicated.
_BASE = r"(\.base_layer)?"
PARTITION_RULES = (
    # The embedding table splits its features: a vocab split would make the token gather
    # all-gather the table (XLA warns "involuntary full rematerialization").
    (rf"embed_tokens{_BASE}\.weight$", P(None, ("tp", "fsdp"))),
    (rf"lm_head{_BASE}\.weight$", P("tp", "fsdp")),
    # Stacked experts (layers, experts, ...): experts over the expert axis (each device its
    # own, edl.ops.expert_parallel), each expert's width over tp, its hidden size over fsdp.
    (rf"experts{_BASE}\.(gate_proj|up_proj)$", P(None, "expert", "tp", "fsdp")),
    (rf"experts{_BASE}\.down_proj$", P(None, "expert", "fsdp", "tp")),
    (rf"(q_proj|k_proj|v_proj|gate_proj|up_proj){_BASE}\.weight$", P(None, "tp", "fsdp")),
    (rf"(q_proj|k_proj|v_proj|gate_proj|up_proj){_BASE}\.bias$", P(None, "tp")),
    (rf"(o_proj|down_proj){_BASE}\.weight$", P(None, "fsdp", "tp")),
    (r"layers\..*\.(qweight|scales)$", P(None, "fsdp")),
    (r"\.(qweight|scales)$", P("fsdp")),
    (r".*", P()),
)
HIDDEN = P(BATCH, "sp", None)  # activations (batch, seq, dim)

Ids = Int[Array, "batch seq"]
Mask = Int[Array, "batch seq"] | jax.Array  # 0/1 ints or bools
Positions = Int[Array, "batch_or_1 seq"]
Hidden = Float[Array, "batch seq dim"]


class ModelOutput(eqx.Module):
    """``last_hidden_state`` after the final norm; ``hidden_states`` (when asked)
    ``(num_layers + 1, batch, seq, dim)``: the embeddings, then each layer's output;
    ``router_stats``: the MoE layers' routing statistics summed over layers (MoE models)."""

    last_hidden_state: Hidden
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None
    cache: KVCacheLike | None = None
    router_stats: RouterStats | None = None


class CausalLMOutput(eqx.Module):
    """A causal LM's ``logits`` ``(batch, seq, vocab)``, with ``hidden_states``,
    ``router_stats`` as in ``ModelOutput``, and the updated ``cache`` when one was passed."""

    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None
    cache: KVCacheLike | None = None
    router_stats: RouterStats | None = None


class SequenceClassifierOutput(eqx.Module):
    """Each row's class ``logits`` ``(batch, num_labels)`` (at its last non-pad token), with
    ``hidden_states`` as in ``ModelOutput``."""

    logits: Float[Array, "batch num_labels"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None


def _sparse_moe(c: DecoderConfig, *, std: float, dtype: DTypeLike, key: PRNGKeyArray) -> SparseMoE:
    return SparseMoE.init(
        c.hidden_size,
        c.expert_intermediate_size,
        c.num_experts,
        c.num_experts_per_tok,
        normalize=c.norm_topk_prob,
        act=c.hidden_act,
        std=std,
        dtype=dtype,
        key=key,
    )


# The MoE MLP of each ``DecoderConfig.MOE_BLOCK`` kind, built from the config; a family with
# its own MoE block (GPT-OSS: edl.models.gpt_oss) registers its builder here.
MOE_BLOCKS: dict[str, Callable[..., SparseMoE | GptOssMoE]] = {"sparse": _sparse_moe}


def _norm(config: DecoderConfig, dtype: DTypeLike) -> RMSNorm:
    return RMSNorm.init(
        config.hidden_size, eps=config.rms_norm_eps, offset=config.norm_offset, dtype=dtype
    )


class DecoderLayer(eqx.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``. With sandwich norms
    (Gemma 2), each branch's output is normalised too before the residual add:
    ``post_attention_layernorm`` then follows attention and ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` wrap the MLP (HF's names for either layout). With post
    norms (OLMo 2) only the outputs are: ``h += norm(attn(h)); h += norm(mlp(h))``, through
    ``post_attention_layernorm`` and ``post_feedforward_layernorm`` (no
    ``input_layernorm``)."""

    self_attn: Attention
    mlp: GatedMLP | SparseMoE | GptOssMoE
    input_layernorm: RMSNorm | None
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm | None
    post_feedforward_layernorm: RMSNorm | None

    @classmethod
    def init(
        cls, config: DecoderConfig, *, mlp: str = "dense", dtype: DTypeLike, key: PRNGKeyArray
    ) -> DecoderLayer:
        """``mlp``: ``"dense"`` (a gated MLP) or ``"moe"`` (``config.num_experts`` experts)."""
        c = config
        k_attn, k_mlp = jax.random.split(key)
        std = c.initializer_range
        attn = Attention.init(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            qkv_bias=c.qkv_bias,
            o_bias=c.o_bias,
            qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
            qk_norm_offset=c.norm_offset,
            qk_norm_over_heads=c.qk_norm_over_heads,
            fused_qkv=c.FUSED_PROJECTIONS,
            sinks=c.attention_sinks,
            std=std,
            dtype=dtype,
            key=k_attn,
        )
        if mlp == "moe":
            block = MOE_BLOCKS[c.MOE_BLOCK](c, std=std, dtype=dtype, key=k_mlp)
        else:
            block = GatedMLP.init(
                c.hidden_size,
                c.intermediate_size,
                act=c.hidden_act,
                use_bias=c.mlp_bias,
                fused=c.FUSED_PROJECTIONS,
                std=std,
                dtype=dtype,
                key=k_mlp,
            )
        pre = None if c.post_norms else _norm(c, dtype)
        pre_mlp = _norm(c, dtype) if c.sandwich_norms else None
        post_mlp = _norm(c, dtype) if c.sandwich_norms or c.post_norms else None
        return cls(attn, block, pre, _norm(c, dtype), pre_mlp, post_mlp)

    def __call__(
        self,
        h: Hidden,
        cos: Float[Array, "batch seq rope_dim"] | None,
        sin: Float[Array, "batch seq rope_dim"] | None,
        segment_ids: tuple[Ids, Ids] | BidirectionalBlocks | None,
        *,
        config: DecoderConfig,
        window: int | None = None,
        token_mask: Float[Array, "batch seq"] | None = None,
    ) -> tuple[Hidden, RouterStats | None]:
        """The block and its router statistics (``None`` for a dense MLP); ``token_mask``
        keeps padding out of those statistics. ``cos`` / ``sin`` ``None``: no RoPE."""
        attn = self.self_attn(
            self._pre_attn(h),
            cos,
            sin,
            segment_ids,
            window=window,
            softcap=config.attn_softcap,
            scale=config.attn_scale,
            impl=config.run.attention_impl,
        )
        return self._residual_mlp(self._residual_attn(h, attn), config, token_mask)

    def decode(
        self,
        h: Hidden,
        cos: Float[Array, "batch seq rope_dim"] | None,
        sin: Float[Array, "batch seq rope_dim"] | None,
        cache: KVCacheLike,
        layer: Int[Array, ""] | int,
        *,
        config: DecoderConfig,
        window: int | None = None,
    ) -> tuple[Hidden, KVCacheLike]:
        """The block on new tokens through a KV cache (see ``Attention.decode``)."""
        attn, cache = self.self_attn.decode(
            self._pre_attn(h),
            cos,
            sin,
            cache,
            layer,
            window=window,
            softcap=config.attn_softcap,
            scale=config.attn_scale,
            impl=config.run.attention_impl,
        )
        return self._residual_mlp(self._residual_attn(h, attn), config, None)[0], cache

    def _pre_attn(self, h: jax.Array) -> jax.Array:
        return h if self.input_layernorm is None else self.input_layernorm(h)

    def _residual_attn(self, h: jax.Array, attn: jax.Array) -> jax.Array:
        # Sandwich and post norms normalise attention's output; pre-norm the MLP's input.
        if self.pre_feedforward_layernorm is not None or self.input_layernorm is None:
            attn = self.post_attention_layernorm(attn)
        return h + attn.astype(h.dtype)

    def _residual_mlp(self, h, config, token_mask):
        if self.pre_feedforward_layernorm is not None:  # sandwich
            x = self.pre_feedforward_layernorm(h)
        elif self.input_layernorm is None:  # post norms: the MLP sees the residual
            x = h
        else:
            x = self.post_attention_layernorm(h)
        stats = None
        if isinstance(self.mlp, SparseMoE | GptOssMoE):
            y, stats = self.mlp(
                x,
                token_mask,
                impl=config.run.moe_impl,
                capacity_factor=config.run.moe_capacity_factor,
            )
        else:
            y = self.mlp(x)
        if self.post_feedforward_layernorm is not None:
            y = self.post_feedforward_layernorm(y)
        return h + y.astype(h.dtype), stats


def _positions_from_segments(segment_ids: Ids) -> Ids:
    """Positions restarting at 0 where the segment id changes (packed sequences)."""
    seq = segment_ids.shape[1]
    t = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], segment_ids.shape)
    starts = jnp.concatenate(
        [
            jnp.ones_like(segment_ids[:, :1], jnp.bool_),
            segment_ids[:, 1:] != segment_ids[:, :-1],
        ],
        axis=1,
    )
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def _rope_tables(
    positions: Ids,
    config: DecoderConfig,
    valid: Mask | None = None,
    min_length: Int[Array, " batch"] | None = None,
) -> dict:
    """``(cos, sin)`` for each RoPE the layers use (``config.layer_settings``), computed once
    for all layers; ``None`` (NoPE layers) maps to ``(None, None)``. ``valid``: the new
    tokens of a cached call (``rope_tables``: the length of length-dependent RoPEs);
    ``min_length``: each row's length at least (``rope_tables``)."""
    ropes = dict.fromkeys(rope for _, rope in config.layer_settings)
    per_row = config.run.rope_length == "row"
    return {
        r: (None, None)
        if r is None
        else rope_tables(positions, r, valid, per_row=per_row, min_length=min_length)
        for r in ropes
    }


def _check_2d(name: str, x: jax.Array | None, batch: int, seq: int) -> None:
    if x is not None and x.shape != (batch, seq):
        raise ValueError(f"{name} must be (batch, seq) = {(batch, seq)}, got {x.shape}")


def _check_not_empty(input_ids: jax.Array | None, inputs_embeds: jax.Array | None) -> None:
    """An empty sequence would fail deep inside the attention kernel; say so up front."""
    name, x = (
        ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
    )
    if x.ndim >= 2 and x.shape[1] == 0:
        raise ValueError(
            f"{name} has sequence length 0 (shape {x.shape}); each row needs at least one token"
        )


def _broadcast_positions(position_ids: jax.Array, batch: int, seq: int) -> Ids:
    if position_ids.shape[0] == 1 and batch > 1:
        position_ids = jnp.broadcast_to(position_ids, (batch, seq))
    _check_2d("position_ids", position_ids, batch, seq)
    return position_ids


# Stacked (every array has a leading layer axis), or after ``unstacked()`` a tuple of layers.
LayerStack = DecoderLayer | tuple[DecoderLayer, ...]


class DecoderModel(eqx.Module):
    """The decoder trunk: embeddings, stacked decoder layers, final norm."""

    # ``edl.sharding``'s rules=None: every family shares these (a class attribute, static).
    partition_rules: ClassVar[Rules] = PARTITION_RULES
    # The block a family builds its layers of (DeepSeek-V3: MLA and a grouped MoE).
    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer

    embed_tokens: Embedding
    layers: LayerStack
    dense_layers: LayerStack | None  # the dense layers of a model mixing dense and MoE
    norm: RMSNorm
    config: DecoderConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: DecoderConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> DecoderModel:
        """Random weights as HF initialises them (normal(0, initializer_range), norms 1);
        ``dtype`` must be a floating dtype."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_embed, k_layers = jax.random.split(key)
        keys = jax.random.split(k_layers, config.num_hidden_layers)
        stacks = {}
        for group in dict.fromkeys(config.layer_groups):
            mine = [i for i, g in enumerate(config.layer_groups) if g == group]
            mlp = config.layer_mlps[mine[0]]
            stacks[group] = stack(
                lambda k, mlp=mlp: cls.layer_cls.init(config, mlp=mlp, dtype=dtype, key=k),
                keys[jnp.asarray(mine)],
            )
        embed = Embedding.init(
            config.vocab_size,
            config.hidden_size,
            std=config.initializer_range,
            dtype=dtype,
            key=k_embed,
        )
        return cls(
            embed, stacks["layers"], stacks.get("dense_layers"), _norm(config, dtype), config
        )

    def unstacked(self) -> DecoderModel:
        """The same trunk with each layer stack split into a tuple of layers (``unstack``),
        which runs unrolled. Meant for inside a compiled loop that calls the model many
        times (decoding): the weights are sliced once, not on every call."""
        dense = None if self.dense_layers is None else unstack(self.dense_layers)
        return dataclasses.replace(self, layers=unstack(self.layers), dense_layers=dense)

    def _stacks(self) -> tuple[LayerStack | dict[str, LayerStack], tuple[str, ...] | None]:
        """``run_stack``'s ``layers`` and ``groups`` arguments."""
        if self.dense_layers is None:
            return self.layers, None
        return {"layers": self.layers, "dense_layers": self.dense_layers}, self.config.layer_groups

    def embed(self, input_ids: Ids) -> Hidden:
        """Token embeddings (times ``sqrt(hidden_size)`` in the embedding's dtype for Gemma).

        Ids outside ``[0, vocab_size)`` raise ``ValueError`` naming the value, also inside
        ``jax.jit`` (``edl.ops.checks.check_ids``), unless ``config.run.check_inputs`` is off."""
        if self.config.run.check_inputs:
            input_ids = check_ids(input_ids, self.config.vocab_size)
        h = self.embed_tokens(input_ids)
        if self.config.embed_scale:
            h = h * jnp.asarray(math.sqrt(self.config.hidden_size), h.dtype)
        return h

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Hidden | None = None,
        attention_mask: Mask | None = None,
        position_ids: Positions | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
        blocks: Ids | None = None,
        rope_min_length: Int[Array, " batch"] | None = None,
    ) -> ModelOutput:
        """Run the trunk on ``input_ids`` or ``inputs_embeds`` (exactly one; embeddings are
        taken as they are, already scaled where the family scales them).

        Args:
            attention_mask: ``(batch, seq)``, 1 for real tokens and 0 for padding (keys at
                padded positions are hidden from every query, and padding is left out of
                the MoE router statistics).
            position_ids: RoPE positions; default ``0..seq-1``, or restarting at each segment
                when ``segment_ids`` is given.
            segment_ids: ``(batch, seq)`` ids of packed sequences: a token attends only to
                earlier tokens of its own segment.
            cache: a KV cache (``edl.generate.init_cache``): the tokens are new ones that
                follow each row's cached ``lengths`` (positions default to
                ``lengths[b] + i``), are written into the cache and attend to it; the
                updated cache is returned in the output. With a cache, ``attention_mask``
                must be right-padded (ones, then zeros: the row's valid new tokens), and
                ``segment_ids`` / ``output_hidden_states`` are not supported.
            blocks: ``(batch, seq)`` ids of blocks whose tokens attend to each other both
                ways, ``-1`` elsewhere (Gemma 3's images, ``edl.ops.block_attention``);
                not with a cache.
            rope_min_length: ``(batch,)``, with a cache only: each row's length for
                length-dependent RoPEs is at least this (``edl.ops.rope.rope_tables``;
                the serving engine's chunks of a longer sequence).
        """
        c = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        _check_not_empty(input_ids, inputs_embeds)
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if h.ndim != 3 or h.shape[2] != c.hidden_size:
            raise ValueError(f"inputs_embeds must be (batch, seq, {c.hidden_size}), got {h.shape}")
        h = constrain(h, HIDDEN)
        batch, seq = h.shape[:2]
        _check_2d("attention_mask", attention_mask, batch, seq)
        _check_2d("segment_ids", segment_ids, batch, seq)
        _check_2d("blocks", blocks, batch, seq)
        if cache is not None:
            if blocks is not None:
                raise ValueError("with a cache, blocks are not supported")
            return self._decode(
                h,
                attention_mask,
                position_ids,
                cache,
                segment_ids,
                output_hidden_states,
                rope_min_length,
            )
        if position_ids is None:
            position_ids = (
                _positions_from_segments(segment_ids)
                if segment_ids is not None
                else jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
            )
        position_ids = _broadcast_positions(position_ids, batch, seq)
        tables = _rope_tables(position_ids, c)
        segments = padding_segments(attention_mask, segment_ids)
        if blocks is not None:
            segments = BidirectionalBlocks.of(segments, blocks)
        token_mask = None if attention_mask is None else attention_mask.astype(jnp.float32)

        def apply(layer: DecoderLayer, carry, setting, _):
            h, stats = carry
            window, rope = setting
            h, layer_stats = layer(
                h, *tables[rope], segments, config=c, window=window, token_mask=token_mask
            )
            if layer_stats is not None:
                stats = stats + layer_stats
            return constrain(h, HIDDEN), stats

        stats0 = RouterStats.zeros(c.num_experts) if "moe" in c.layer_mlps else None
        layers, groups = self._stacks()
        (h_out, stats), per_layer = run_stack(
            layers,
            (h, stats0),
            apply,
            settings=c.layer_settings,
            groups=groups,
            scan=c.run.scan_layers,
            remat=c.run.remat,
            collect=output_hidden_states,
        )
        hidden_states = None
        if per_layer is not None:
            hidden_states = jnp.concatenate([h[None], per_layer[0]], axis=0)
        # The trunk's output carries the activation sharding like every layer's: left to
        # propagation, a tied head's embedding sharding (dim over tp x fsdp) reached it and
        # XLA's partitioner computed wrong logits on a (2, 2, 2, 1) mesh (SmolLM3, Gemma 3).
        return ModelOutput(constrain(self.norm(h_out), HIDDEN), hidden_states, router_stats=stats)

    def _decode(
        self,
        h,
        attention_mask,
        position_ids,
        cache,
        segment_ids,
        output_hidden_states,
        rope_min_length=None,
    ):
        """``__call__`` with a KV cache: new tokens through every layer's cache."""
        c = self.config
        if segment_ids is not None or output_hidden_states:
            raise ValueError("with a cache, segment_ids and output_hidden_states are not supported")
        batch, seq = h.shape[:2]
        if position_ids is None:
            position_ids = cache.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None]
        position_ids = _broadcast_positions(position_ids, batch, seq)
        num_new = (
            jnp.full((batch,), seq, jnp.int32)
            if attention_mask is None
            else jnp.sum(attention_mask.astype(jnp.int32), axis=1)
        )
        tables = _rope_tables(position_ids, c, valid=attention_mask, min_length=rope_min_length)

        def apply(layer: DecoderLayer, carry, setting, index):
            h, cache = carry
            window, rope = setting
            return layer.decode(h, *tables[rope], cache, index, config=c, window=window)

        layers, groups = self._stacks()
        (h, cache), _ = run_stack(
            layers,
            (h, cache.reserve(num_new)),
            apply,
            settings=c.layer_settings,
            groups=groups,
            scan=c.run.scan_layers,
        )
        return ModelOutput(constrain(self.norm(h), HIDDEN), cache=cache.advance(num_new))
