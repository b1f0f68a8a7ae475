"""Parts shared by the CLIP and SigLIP towers: the stacked encoder, text and patch
embeddings, SigLIP's attention-pooling head, and the towers' output.

Field names are HF's (``embeddings.patch_embedding``, ``encoder.layers.self_attn.q_proj``,
...), with the encoder layers stacked along a leading layer axis and run by ``lax.scan``
(``run.scan_layers``), as the decoders' are.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.models.encoder_config import TextTowerConfig, TowerConfig, VisionTowerConfig
from edl.nn.encoder import MLP, EncoderLayer
from edl.nn.layers import Embedding, LayerNorm, Linear, add_bias
from edl.nn.stack import run_stack, stack
from edl.ops.attention import SegmentIds, attention
from edl.ops.checks import check_ids
from edl.ops.matmul import linear

__all__ = [
    "AttentionPoolingHead",
    "Encoder",
    "EncoderOutput",
    "MultiheadAttention",
    "PatchEmbedding",
    "TextEmbeddings",
    "VisionEmbeddings",
]

Hidden = Float[Array, "batch seq dim"]
Pixels = Float[Array, "batch channels height width"]


class EncoderOutput(eqx.Module):
    """A tower's ``last_hidden_state``, ``pooler_output`` (its pooled, for the text towers
    of CLIP's ``...WithProjection`` and the dual models projected, embedding) and, when
    asked, ``hidden_states`` ``(num_layers + 1, batch, seq, dim)``: the encoder's input
    then each layer's output, as transformers' ``hidden_states`` tuple."""

    last_hidden_state: Hidden
    pooler_output: Float[Array, "batch out"] | None
    hidden_states: Float[Array, "layers_plus_one batch seq dim"] | None = None


class Encoder(eqx.Module):
    """``num_hidden_layers`` pre-norm ``EncoderLayer``s, stacked (``layers``: every array
    has a leading layer axis)."""

    layers: EncoderLayer | tuple[EncoderLayer, ...]

    @classmethod
    def init(cls, config: TowerConfig, *, dtype: DTypeLike, key: PRNGKeyArray) -> Encoder:
        c = config

        def layer(k: PRNGKeyArray) -> EncoderLayer:
            return EncoderLayer.init(
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                act=c.hidden_act,
                eps=c.layer_norm_eps,
                std=c.initializer_range,
                dtype=dtype,
                key=k,
            )

        return cls(stack(layer, jax.random.split(key, c.num_hidden_layers)))

    def __call__(
        self,
        h: Hidden,
        *,
        config: TowerConfig,
        segment_ids: SegmentIds | None = None,
        causal: bool = False,
        output_hidden_states: bool = False,
    ) -> tuple[Hidden, Float[Array, "layers_plus_one batch seq dim"] | None]:
        """``(last layer's output, hidden_states or None)``."""
        impl = config.run.attention_impl

        def apply(layer: EncoderLayer, h: Hidden, _setting: None, _index: jax.Array) -> Hidden:
            return layer(h, segment_ids, causal=causal, impl=impl)

        out, per_layer = run_stack(
            self.layers,
            h,
            apply,
            scan=config.run.scan_layers,
            remat=config.run.remat,
            collect=output_hidden_states,
        )
        hidden = None if per_layer is None else jnp.concatenate([h[None], per_layer], axis=0)
        return out, hidden


class TextEmbeddings(eqx.Module):
    """Token embeddings plus learned absolute position embeddings."""

    token_embedding: Embedding
    position_embedding: Embedding

    @classmethod
    def init(
        cls, config: TextTowerConfig, *, dtype: DTypeLike, key: PRNGKeyArray
    ) -> TextEmbeddings:
        k_tok, k_pos = jax.random.split(key)
        std = config.initializer_range
        return cls(
            Embedding.init(config.vocab_size, config.hidden_size, std=std, dtype=dtype, key=k_tok),
            Embedding.init(
                config.max_position_embeddings, config.hidden_size, std=std, dtype=dtype, key=k_pos
            ),
        )

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        *,
        config: TextTowerConfig,
        position_ids: Int[Array, "batch_or_1 seq"] | None = None,
    ) -> Hidden:
        """Ids outside the vocabulary raise (``check_ids``) unless ``run.check_inputs`` is
        off; sequences longer than ``max_position_embeddings`` raise."""
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (batch, seq > 0), got shape {input_ids.shape}")
        seq, limit = input_ids.shape[1], config.max_position_embeddings
        if seq > limit:
            raise ValueError(
                f"input_ids has {seq} tokens; this text tower takes at most "
                f"max_position_embeddings = {limit}"
            )
        if config.run.check_inputs:
            input_ids = check_ids(input_ids, config.vocab_size)
        if position_ids is None:
            position_ids = jnp.arange(seq, dtype=jnp.int32)[None]
        # (batch or 1, seq, dim): a shared row of positions broadcasts over the batch.
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class PatchEmbedding(eqx.Module):
    """torch's ``Conv2d(channels, dim, kernel_size=patch, stride=patch)`` (weight
    ``(dim, channels, patch, patch)``), computed as one GEMM over the flattened patches."""

    weight: Float[Array, "dim channels patch patch2"]
    bias: Float[Array, " dim"] | None

    @classmethod
    def init(
        cls,
        channels: int,
        dim: int,
        patch: int,
        *,
        use_bias: bool,
        std: float,
        dtype: DTypeLike,
        key: PRNGKeyArray,
    ) -> PatchEmbedding:
        weight = std * jax.random.normal(key, (dim, channels, patch, patch), dtype)
        return cls(weight, jnp.zeros((dim,), dtype) if use_bias else None)

    def __call__(self, pixel_values: Pixels) -> Float[Array, "batch patches dim"]:
        """Patches in row-major order (``(h w)``), as the conv's output flattens."""
        dim, channels, p, _ = self.weight.shape
        if pixel_values.ndim != 4 or pixel_values.shape[1] != channels:
            raise ValueError(
                f"pixel_values must be (batch, {channels}, height, width), got {pixel_values.shape}"
            )
        patches = rearrange(pixel_values, "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)
        flat = self.weight.reshape(dim, channels * p * p)
        return add_bias(linear(patches.astype(self.weight.dtype), flat), self.bias)


class VisionEmbeddings(eqx.Module):
    """Patch embeddings (after a learned ``class_embedding`` token where the tower has one:
    CLIP) plus learned position embeddings."""

    patch_embedding: PatchEmbedding
    position_embedding: Embedding
    class_embedding: Float[Array, " dim"] | None

    @classmethod
    def init(
        cls,
        config: VisionTowerConfig,
        *,
        class_token: bool,
        patch_bias: bool,
        dtype: DTypeLike,
        key: PRNGKeyArray,
    ) -> VisionEmbeddings:
        c, std = config, config.initializer_range
        k_patch, k_pos, k_cls = jax.random.split(key, 3)
        patch = PatchEmbedding.init(
            c.num_channels,
            c.hidden_size,
            c.patch_size,
            use_bias=patch_bias,
            std=std,
            dtype=dtype,
            key=k_patch,
        )
        positions = c.num_patches + int(class_token)
        pos = Embedding.init(positions, c.hidden_size, std=std, dtype=dtype, key=k_pos)
        cls_token = std * jax.random.normal(k_cls, (c.hidden_size,), dtype) if class_token else None
        return cls(patch, pos, cls_token)

    def __call__(self, pixel_values: Pixels, *, config: VisionTowerConfig) -> Hidden:
        """``pixel_values`` must be ``image_size`` square (no position interpolation)."""
        size = config.image_size
        if pixel_values.ndim != 4 or pixel_values.shape[2:] != (size, size):
            raise ValueError(
                f"pixel_values must be (batch, {config.num_channels}, {size}, {size}) for "
                f"this tower (image_size {size}), got {pixel_values.shape}"
            )
        h = self.patch_embedding(pixel_values)
        if self.class_embedding is not None:
            token = jnp.broadcast_to(
                self.class_embedding.astype(h.dtype), (h.shape[0], 1, h.shape[2])
            )
            h = jnp.concatenate([token, h], axis=1)
        return h + self.position_embedding.weight.astype(h.dtype)[None]


class MultiheadAttention(eqx.Module):
    """torch's ``nn.MultiheadAttention`` (``batch_first``) layout: ``in_proj_weight``
    ``(3 * dim, dim)`` holding q, k and v, ``in_proj_bias``, ``out_proj``."""

    in_proj_weight: Float[Array, "three_dim dim"]
    in_proj_bias: Float[Array, " three_dim"]
    out_proj: Linear
    num_heads: int = eqx.field(static=True)

    @classmethod
    def init(
        cls, dim: int, num_heads: int, *, std: float, dtype: DTypeLike, key: PRNGKeyArray
    ) -> MultiheadAttention:
        k_in, k_out = jax.random.split(key)
        weight = std * jax.random.normal(k_in, (3 * dim, dim), dtype)
        out = Linear.init(dim, dim, use_bias=True, std=std, dtype=dtype, key=k_out)
        return cls(weight, jnp.zeros((3 * dim,), dtype), out, num_heads=num_heads)

    def __call__(
        self, query: Float[Array, "batch q_len dim"], memory: Float[Array, "batch kv_len dim"]
    ) -> Float[Array, "batch q_len dim"]:
        """``query`` attends to ``memory`` (keys and values), unmasked."""
        dim = query.shape[-1]
        w_q, w_k, w_v = jnp.split(self.in_proj_weight, 3)
        b_q, b_k, b_v = jnp.split(self.in_proj_bias, 3)
        heads = self.num_heads

        def project(x, w, b):
            return add_bias(linear(x, w), b).reshape(*x.shape[:2], heads, dim // heads)

        q = project(query, w_q, b_q)
        k, v = project(memory, w_k, b_k), project(memory, w_v, b_v)
        out = attention(q, k, v, impl="xla")  # one query: too small for a kernel
        return self.out_proj(out.reshape(query.shape))


class AttentionPoolingHead(eqx.Module):
    """SigLIP's pooling: a learned ``probe`` query attends over the tokens, then a residual
    ``mlp`` behind ``layernorm``; the probe's output is the pooled embedding."""

    probe: Float[Array, "1 1 dim"]
    attention: MultiheadAttention
    layernorm: LayerNorm
    mlp: MLP

    @classmethod
    def init(
        cls, config: VisionTowerConfig, *, dtype: DTypeLike, key: PRNGKeyArray
    ) -> AttentionPoolingHead:
        c, std = config, config.initializer_range
        k_probe, k_attn, k_mlp = jax.random.split(key, 3)
        return cls(
            std * jax.random.normal(k_probe, (1, 1, c.hidden_size), dtype),
            MultiheadAttention.init(
                c.hidden_size, c.num_attention_heads, std=std, dtype=dtype, key=k_attn
            ),
            LayerNorm.init(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype),
            MLP.init(
                c.hidden_size,
                c.intermediate_size,
                act=c.hidden_act,
                std=std,
                dtype=dtype,
                key=k_mlp,
            ),
        )

    def __call__(self, h: Hidden) -> Float[Array, "batch dim"]:
        probe = jnp.broadcast_to(self.probe.astype(h.dtype), (h.shape[0], 1, h.shape[2]))
        pooled = self.attention(probe, h)
        pooled = pooled + self.mlp(self.layernorm(pooled))
        return pooled[:, 0]
