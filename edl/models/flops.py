"""Matmul FLOPs per token of a decoder (EasyDeL's ``flops_per_token``, for MFU).

``flops_per_token`` sums ``config.layer_flops(i, seq_len)`` over the layers plus the LM
head. The default layer (``decoder_layer_flops``) is grouped-query attention and a dense or
MoE MLP; families whose layers differ (MLA, linear attention, shared experts) override
``layer_flops`` on their config class and build it from the pieces here. Every count is a
forward count at 2 FLOPs per multiply-accumulate; training is 3x (backward = 2x forward).
Elementwise work (norms, softmax, RoPE, gates, the short causal convolution) is not counted.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "attention_score_flops",
    "decoder_layer_flops",
    "flops_per_token",
    "mlp_flops",
    "visible_keys",
]


def visible_keys(window: int | None, seq_len: int) -> float:
    """The number of keys a causal query sees, averaged over the ``seq_len`` positions of a
    sequence: ``min(t + 1, window)`` at position ``t``."""
    w = seq_len if window is None else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def attention_score_flops(
    heads: int, qk_dim: int, v_dim: int, window: int | None, seq_len: int
) -> float:
    """``q @ k`` and ``p @ v`` over the keys each query sees (causal, sliding ``window``)."""
    return 2.0 * heads * (qk_dim + v_dim) * visible_keys(window, seq_len)


def mlp_flops(config: Any, kind: str, *, shared: int = 0) -> float:
    """A ``"dense"`` gated MLP (``intermediate_size``) or a ``"moe"`` layer: the router and
    the ``num_experts_per_tok`` experts a token runs through, plus ``shared`` always-on
    multiply-accumulates (shared experts)."""
    d = config.hidden_size
    if kind == "dense":
        return 2.0 * 3 * d * config.intermediate_size
    active = config.num_experts_per_tok * 3 * d * config.expert_intermediate_size
    return 2.0 * (d * config.num_experts + active + shared)


def decoder_layer_flops(config: Any, index: int, seq_len: int) -> float:
    """Layer ``index`` of the shared decoder: q / k / v / o projections, attention over its
    window, and its MLP kind."""
    c = config
    d, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    projections = 2.0 * (d * heads * hd + 2 * d * kv * hd + heads * hd * d)
    scores = attention_score_flops(heads, hd, hd, c.layer_windows[index], seq_len)
    return projections + scores + mlp_flops(c, c.layer_mlps[index])


def flops_per_token(config: Any, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token for sequences of ``seq_len`` tokens.

    Counts every projection (``2 * in * out`` per token), the MoE router and only the
    ``num_experts_per_tok`` experts each token runs through (and shared experts), the LM
    head, and causal attention scores and values over the keys each query actually sees
    (sliding windows included), averaged over positions. Training is 3x the forward pass.
    """
    layers = sum(config.layer_flops(i, seq_len) for i in range(config.num_hidden_layers))
    forward = layers + 2.0 * config.hidden_size * config.vocab_size
    return 3.0 * forward if training else forward
