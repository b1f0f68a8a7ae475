"""Llama-family decoders (HF ``model_type`` llama, mistral, qwen2, qwen3) and task heads.

Module tree and field names mirror transformers (``model.embed_tokens``,
``model.layers.self_attn.q_proj``, ``model.norm``, ``lm_head``), except that the decoder
layers are one stacked module whose arrays carry a leading layer axis, so
``"model.layers.mlp.up_proj.weight"`` is ``(num_layers, intermediate, hidden)`` and the HF key
table (``HF_KEYS``) is the identity plus that stacking.

    config = LlamaConfig.from_hf(json.load(open("config.json")))
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    logits = model(input_ids, attention_mask=mask).logits
    loss, metrics = model.compute_loss(input_ids, attention_mask=mask)
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.keymap import KeyTable
from edl.models.llama_config import MODEL_TYPES, LlamaConfig
from edl.nn.attention import Attention, KVCacheLike
from edl.nn.layers import Embedding, Linear, RMSNorm
from edl.nn.mlp import GatedMLP
from edl.nn.stack import run_stack, stack
from edl.ops.losses import causal_lm_loss, sequence_classification_loss
from edl.ops.rope import rope_tables
from edl.sharding import BATCH, constrain

__all__ = [
    "HF_KEYS",
    "MODEL_TYPES",
    "PARTITION_RULES",
    "CausalLMOutput",
    "DecoderLayer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaModel",
    "ModelOutput",
    "SequenceClassifierOutput",
    "configure",
    "flops_per_token",
]

HF_KEYS = KeyTable(
    rules=(
        ("model.layers.{layer}.{name}", "model.layers.{name}"),
        ("layers.{layer}.{name}", "layers.{name}"),  # the bare trunk (HF LlamaModel)
        ("{name}", "{name}"),
    ),
    # Buffers some older checkpoints saved; edl computes RoPE tables in the forward pass.
    ignore_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)

# Tensor-parallel column splits (q/k/v, gate/up: output features over tp) and row splits
# (o, down: input features over tp), FSDP over the other dimension; the stacked layer axis is
# never split. Norms and the classification head are replicated (the catch-all).
PARTITION_RULES = (
    # The embedding table splits its features: a vocab split would make the token gather
    # all-gather the table (XLA warns "involuntary full rematerialization").
    (r"embed_tokens\.weight$", P(None, ("tp", "fsdp"))),
    (r"lm_head\.weight$", P("tp", "fsdp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P(None, "tp", "fsdp")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.bias$", P(None, "tp")),
    (r"(o_proj|down_proj)\.weight$", P(None, "fsdp", "tp")),
    (r".*", P()),
)
HIDDEN = P(BATCH, "sp", None)  # activations (batch, seq, dim)

Ids = Int[Array, "batch seq"]
Mask = Int[Array, "batch seq"] | jax.Array  # 0/1 ints or bools


class ModelOutput(eqx.Module):
    """``last_hidden_state`` after the final norm; ``hidden_states`` (when asked)
    ``(num_layers + 1, batch, seq, dim)``: the embeddings, then each layer's output."""

    last_hidden_state: Float[Array, "batch seq dim"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None
    cache: KVCacheLike | None = None


class CausalLMOutput(eqx.Module):
    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None
    cache: KVCacheLike | None = None


class SequenceClassifierOutput(eqx.Module):
    logits: Float[Array, "batch num_labels"]
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None


class DecoderLayer(eqx.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    self_attn: Attention
    mlp: GatedMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    @classmethod
    def init(cls, config: LlamaConfig, *, dtype: DTypeLike, key: PRNGKeyArray) -> DecoderLayer:
        c = config
        k_attn, k_mlp = jax.random.split(key)
        std = c.initializer_range
        return cls(
            Attention.init(
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                qkv_bias=c.qkv_bias,
                o_bias=c.o_bias,
                qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
                std=std,
                dtype=dtype,
                key=k_attn,
            ),
            GatedMLP.init(
                c.hidden_size,
                c.intermediate_size,
                act=c.hidden_act,
                use_bias=c.mlp_bias,
                std=std,
                dtype=dtype,
                key=k_mlp,
            ),
            RMSNorm.init(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype),
            RMSNorm.init(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype),
        )

    def __call__(
        self,
        h: Float[Array, "batch seq dim"],
        cos: Float[Array, "batch seq rope_dim"],
        sin: Float[Array, "batch seq rope_dim"],
        segment_ids: tuple[Ids, Ids] | None,
        *,
        window: int | None = None,
        impl: str = "auto",
    ) -> Float[Array, "batch seq dim"]:
        attn = self.self_attn(
            self.input_layernorm(h), cos, sin, segment_ids, window=window, impl=impl
        )
        return self._residual_mlp(h + attn.astype(h.dtype))

    def decode(
        self,
        h: Float[Array, "batch seq dim"],
        cos: Float[Array, "batch seq rope_dim"],
        sin: Float[Array, "batch seq rope_dim"],
        cache: KVCacheLike,
        layer: Int[Array, ""] | int,
        *,
        window: int | None = None,
        impl: str = "auto",
    ) -> tuple[Float[Array, "batch seq dim"], KVCacheLike]:
        """The block on new tokens through a KV cache (see ``Attention.decode``)."""
        attn, cache = self.self_attn.decode(
            self.input_layernorm(h), cos, sin, cache, layer, window=window, impl=impl
        )
        return self._residual_mlp(h + attn.astype(h.dtype)), cache

    def _residual_mlp(self, h: jax.Array) -> jax.Array:
        return h + self.mlp(self.post_attention_layernorm(h)).astype(h.dtype)


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


def _attention_segments(
    batch: int, seq: int, attention_mask: Mask | None, segment_ids: Ids | None
) -> tuple[Ids, Ids] | None:
    """``(q_ids, kv_ids)`` for ``edl.ops.attention``: padded keys (mask 0) match no query."""
    if attention_mask is None and segment_ids is None:
        return None
    q_ids = (
        jnp.ones((batch, seq), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    )
    if attention_mask is None:
        return q_ids, q_ids
    return q_ids, jnp.where(attention_mask.astype(jnp.bool_), q_ids, -1)


def _check_2d(name: str, x: jax.Array | None, batch: int, seq: int) -> None:
    if x is not None and x.shape != (batch, seq):
        raise ValueError(f"{name} must be (batch, seq) = {(batch, seq)}, got {x.shape}")


class LlamaModel(eqx.Module):
    """The decoder trunk: embeddings, stacked decoder layers, final norm."""

    embed_tokens: Embedding
    layers: DecoderLayer  # stacked: every array has a leading num_hidden_layers axis
    norm: RMSNorm
    config: LlamaConfig = eqx.field(static=True)

    @classmethod
    def init(
        cls, config: LlamaConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> LlamaModel:
        """Random weights as HF initialises them (normal(0, initializer_range), norms 1)."""
        k_embed, k_layers = jax.random.split(key)
        layer_keys = jax.random.split(k_layers, config.num_hidden_layers)
        return cls(
            Embedding.init(
                config.vocab_size, config.hidden_size, std=config.initializer_range, dtype=dtype,
                key=k_embed,
            ),
            stack(lambda k: DecoderLayer.init(config, dtype=dtype, key=k), layer_keys),
            RMSNorm.init(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype),
            config,
        )  # fmt: skip

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> ModelOutput:
        """Run the trunk on ``input_ids`` or ``inputs_embeds`` (exactly one).

        Args:
            attention_mask: ``(batch, seq)``, 1 for real tokens and 0 for padding (keys at
                padded positions are hidden from every query).
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
        """
        c = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = constrain(h, HIDDEN)
        batch, seq = h.shape[:2]
        if h.ndim != 3 or h.shape[2] != c.hidden_size:
            raise ValueError(f"inputs_embeds must be (batch, seq, {c.hidden_size}), got {h.shape}")
        _check_2d("attention_mask", attention_mask, batch, seq)
        _check_2d("segment_ids", segment_ids, batch, seq)
        if cache is not None:
            return self._decode(h, attention_mask, position_ids, cache, segment_ids,
                                output_hidden_states)  # fmt: skip
        if position_ids is None:
            position_ids = (
                _positions_from_segments(segment_ids)
                if segment_ids is not None
                else jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
            )
        position_ids = _broadcast_positions(position_ids, batch, seq)
        cos, sin = rope_tables(position_ids, c.rope)
        segments = _attention_segments(batch, seq, attention_mask, segment_ids)

        def apply(layer: DecoderLayer, h: jax.Array, window: int | None, _) -> jax.Array:
            h = layer(h, cos, sin, segments, window=window, impl=c.attention_impl)
            return constrain(h, HIDDEN)

        h0 = h
        h, per_layer = run_stack(
            self.layers,
            h,
            apply,
            settings=c.layer_windows,
            scan=c.scan_layers,
            remat=c.remat,
            collect=output_hidden_states,
        )
        hidden_states = None
        if per_layer is not None:
            hidden_states = jnp.concatenate([h0[None], per_layer], axis=0)
        return ModelOutput(self.norm(h), hidden_states)

    def _decode(self, h, attention_mask, position_ids, cache, segment_ids, output_hidden_states):
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
        cos, sin = rope_tables(position_ids, c.rope)

        def apply(layer: DecoderLayer, carry, window: int | None, index):
            h, cache = carry
            return layer.decode(h, cos, sin, cache, index, window=window, impl=c.attention_impl)

        carry = (h, cache.reserve(num_new))
        (h, cache), _ = run_stack(
            self.layers, carry, apply, settings=c.layer_windows, scan=c.scan_layers
        )
        return ModelOutput(self.norm(h), cache=cache.advance(num_new))


def _broadcast_positions(position_ids: jax.Array, batch: int, seq: int) -> Ids:
    if position_ids.shape[0] == 1 and batch > 1:
        position_ids = jnp.broadcast_to(position_ids, (batch, seq))
    _check_2d("position_ids", position_ids, batch, seq)
    return position_ids


class LlamaForCausalLM(eqx.Module):
    """Decoder + LM head; ``lm_head`` is ``None`` when tied to ``model.embed_tokens``."""

    model: LlamaModel
    lm_head: Linear | None

    @classmethod
    def init(
        cls, config: LlamaConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> LlamaForCausalLM:
        k_model, k_head = jax.random.split(key)
        head = None
        if not config.tie_word_embeddings:
            head = Linear.init(
                config.hidden_size,
                config.vocab_size,
                std=config.initializer_range,
                dtype=dtype,
                key=k_head,
            )
        return cls(LlamaModel.init(config, key=k_model, dtype=dtype), head)

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    @property
    def head_weight(self) -> Float[Array, "vocab dim"]:
        """The output projection ``(vocab, dim)``: ``lm_head.weight`` or the tied embedding."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> CausalLMOutput:
        """Logits ``(batch, seq, vocab)`` in the activation dtype; inputs as ``LlamaModel``
        (with a ``cache``, the updated cache is returned too)."""
        out = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
            output_hidden_states=output_hidden_states,
            cache=cache,
        )
        return CausalLMOutput(self.lm_logits(out.last_hidden_state), out.hidden_states, out.cache)

    def lm_logits(self, h: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]:
        """The LM head on final hidden states (generation applies it to last tokens only)."""
        return self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)

    def compute_loss(
        self,
        input_ids: Ids,
        labels: Ids | None = None,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        segment_ids: Ids | None = None,
        chunk_size: int = 2048,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """Next-token cross entropy (HF semantics), without ever forming full logits.

        ``labels`` default to ``input_ids``. Not predicted: ``-100`` labels, padded tokens,
        the token after a padded one (its context is padding), and (with ``segment_ids``)
        the first token of each packed segment.
        Returns ``(loss, {"loss", "accuracy", "tokens"})``.
        """
        labels = input_ids if labels is None else labels
        no_context = jnp.zeros(labels[:, 1:].shape, jnp.bool_)
        if attention_mask is not None:
            no_context |= ~attention_mask[:, :-1].astype(jnp.bool_)
        if segment_ids is not None:
            no_context |= segment_ids[:, 1:] != segment_ids[:, :-1]
        labels = labels.at[:, 1:].set(jnp.where(no_context, -100, labels[:, 1:]))
        hidden = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
        ).last_hidden_state
        return causal_lm_loss(
            hidden, self.head_weight, labels, attention_mask=attention_mask, chunk_size=chunk_size
        )


class LlamaForSequenceClassification(eqx.Module):
    """Decoder + ``score`` head read at each row's last non-padding token (HF semantics)."""

    model: LlamaModel
    score: Linear

    @classmethod
    def init(
        cls, config: LlamaConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> LlamaForSequenceClassification:
        k_model, k_head = jax.random.split(key)
        score = Linear.init(
            config.hidden_size,
            config.num_labels,
            std=config.initializer_range,
            dtype=dtype,
            key=k_head,
        )
        return cls(LlamaModel.init(config, key=k_model, dtype=dtype), score)

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Float[Array, "batch seq dim"] | None = None,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
    ) -> SequenceClassifierOutput:
        """Logits ``(batch, num_labels)`` at the last non-pad token of each row.

        That token is found as HF does: the last position whose id differs from
        ``config.pad_token_id``; without a pad id (or with ``inputs_embeds``) the last
        position with ``attention_mask`` 1, else the last position.
        """
        out = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
            output_hidden_states=output_hidden_states,
        )
        h = out.last_hidden_state
        batch, seq = h.shape[:2]
        if input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        elif attention_mask is not None:
            real = attention_mask.astype(jnp.bool_)
        else:
            real = jnp.ones((batch, seq), jnp.bool_)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
        last = jnp.max(jnp.where(real, positions, 0), axis=1)
        pooled = jnp.take_along_axis(h, last.reshape(batch, 1, 1), axis=1)[:, 0]
        return SequenceClassifierOutput(self.score(pooled), out.hidden_states)

    def compute_loss(
        self,
        input_ids: Ids,
        labels: jax.Array,
        *,
        attention_mask: Mask | None = None,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """HF's sequence-classification loss (MSE / CE / BCE by ``config.problem_type``)."""
        logits = self(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        return sequence_classification_loss(logits, labels, problem_type=self.config.problem_type)


LlamaLike = LlamaModel | LlamaForCausalLM | LlamaForSequenceClassification


def configure(model: LlamaLike, **changes: object) -> LlamaLike:
    """The same weights under a changed config, e.g. ``configure(m, scan_layers=False)``
    or ``remat="full"`` or ``attention_impl="reference"``. Array-shaping fields must not
    change."""
    trunk = model if isinstance(model, LlamaModel) else model.model
    new_config = trunk.config.replace(**changes)
    new_trunk = dataclasses.replace(trunk, config=new_config)
    if isinstance(model, LlamaModel):
        return new_trunk
    return dataclasses.replace(model, model=new_trunk)


def flops_per_token(config: LlamaConfig, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token for sequences of ``seq_len`` tokens (EasyDeL's
    ``flops_per_token``).

    Counts every projection (``2 * in * out`` per token), the LM head, and causal attention
    scores and values over the keys each query actually sees (sliding windows included),
    averaged over positions. Training is 3x the forward pass (backward = 2x forward).
    Elementwise work (norms, softmax, RoPE) is not counted.
    """
    c = config
    d, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * c.intermediate_size
    forward = 2.0 * (c.num_hidden_layers * per_layer + d * c.vocab_size)
    for window in c.layer_windows:
        w = seq_len if window is None else min(window, seq_len)
        # mean over positions t of min(t + 1, w) visible keys
        visible = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
        forward += 2 * 2 * heads * hd * visible  # q.k and p.v
    return 3.0 * forward if training else forward
