"""LoRA as pure model -> model functions.

    model = edl.lora.apply_lora(model, rank=8, alpha=16, key=jax.random.key(0))
    state = edl.create_state(model, tx, trainable=edl.lora.lora_trainable)  # A/B only
    ...                                             # train as usual (edl.train works as is)
    merged = edl.lora.merge_lora(model)             # W + (alpha/r) B A, adapters gone
    base = edl.lora.unwrap_lora(model)              # the untouched base model

``apply_lora`` wraps every linear layer whose path matches ``pattern`` in a ``LoraLinear``
(``edl.nn.lora``): the base keeps its arrays under ``<layer>.base_layer``, the adapters are
``<layer>.lora_A.weight (r, in)`` and ``<layer>.lora_B.weight (out, r)``, with the layer
axis in front in a layer stack. On a quantized model (``edl.quantize``) this is QLoRA.

Adapters in PEFT's file format (``save_adapter`` / ``load_adapter``) are ``edl.io.formats.peft``:
files sit a layer above model surgery, and this module reaches nothing above it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray, PyTree

from edl.module import split
from edl.nn.lora import LoraLinear, leading_shape
from edl.quantize import DEFAULT_PATTERN, is_linear
from edl.tree import compile_pattern, find, is_none, tree_apply

__all__ = [
    "DEFAULT_PATTERN",
    "apply_lora",
    "lora_layers",
    "lora_params",
    "lora_trainable",
    "merge_lora",
    "unwrap_lora",
    "with_dropout_key",
    "wrap_lora",
]

lora_trainable = re.compile(r"(^|\.)lora_[AB]\.weight$")
"""``trainable=`` for ``edl.split`` / ``edl.create_state``: only the LoRA A/B matrices, so
gradients and optimizer state exist for nothing else."""


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraLinear)


def lora_layers(model: PyTree, what: str = "lora_layers") -> dict[str, LoraLinear]:
    """Every ``LoraLinear`` of ``model`` by path; a ``ValueError`` (naming the caller,
    ``what``) when there is none."""
    layers = find(model, _is_lora)
    if not layers:
        raise ValueError(f"{what}: the model has no LoRA adapters (edl.lora.apply_lora)")
    return layers


def wrap_lora(
    model: PyTree,
    layers: Mapping[str, tuple[int, float]],
    *,
    dropout: float | int = 0.0,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
    what: str = "wrap_lora",
) -> PyTree:
    """``apply_lora`` with a rank and scale per layer: a ``LoraLinear`` around the linear
    layer at each path of ``layers`` (``path -> (rank, scaling)``, PEFT's per-module ranks
    and alphas). Errors name the caller, ``what``."""
    linear = find(model, is_linear)
    unknown = sorted(set(layers) - set(linear))
    if unknown:
        raise ValueError(f"{what}: no linear layer at {unknown}; linear layers: {sorted(linear)}")
    wrapped = sorted(p for p in layers if _is_lora(linear[p]))
    if wrapped:
        raise ValueError(f"{what}: {wrapped} already carry LoRA adapters (unwrap_lora first)")
    keys = dict(zip(layers, jax.random.split(key, len(layers)), strict=True))

    def wrap(path: str):
        rank, scaling = layers[path]
        return lambda layer: LoraLinear.init(
            layer, rank=rank, scaling=scaling, dropout=dropout, dtype=dtype, key=keys[path]
        )

    return tree_apply({p: wrap(p) for p in layers}, model, is_leaf=is_linear)


def apply_lora(
    model: PyTree,
    *,
    rank: int,
    alpha: float | int,
    pattern: str | re.Pattern[str] | None = None,
    dropout: float | int = 0.0,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
) -> PyTree:
    """Wrap the linear layers whose path matches ``pattern`` in LoRA adapters.

    Each matched layer computes ``W x + (alpha / rank) B A x`` with ``A (rank, in)`` drawn
    as PEFT does and ``B (out, rank)`` zero, so the model's outputs are unchanged until B
    is trained. Stacked layers get one adapter per layer (leading axis).

    Args:
        rank, alpha: LoRA's ``r`` and ``lora_alpha``.
        pattern: regex searched in layer paths (``"model.layers.self_attn.q_proj"``);
            default :data:`DEFAULT_PATTERN`, the attention and MLP projections.
        dropout: dropout rate on the adapters' input; it applies only under
            :func:`with_dropout_key` (training), never silently inside generation.
        dtype: of A and B; default the base weight's dtype (a quantized base's original).
        key: for A.
    """
    if rank < 1:
        raise ValueError(f"apply_lora: rank must be >= 1, got {rank}")
    regex = compile_pattern(DEFAULT_PATTERN if pattern is None else pattern)
    targets = find(model, is_linear, regex)
    if not targets:
        raise ValueError(
            f"apply_lora: pattern {regex.pattern!r} matches none of the linear layers "
            f"{sorted(find(model, is_linear))}"
        )
    layers = dict.fromkeys(targets, (rank, alpha / rank))
    return wrap_lora(model, layers, dropout=dropout, dtype=dtype, key=key, what="apply_lora")


def merge_lora(model: PyTree) -> PyTree:
    """Fold every adapter into its base weight: ``W <- W + scaling * B @ A`` (in float32).
    The result has the structure of the model before ``apply_lora``; a quantized base is
    quantized again after merging."""
    layers = lora_layers(model, "merge_lora")
    return tree_apply({p: LoraLinear.merge for p in layers}, model, is_leaf=_is_lora)


def unwrap_lora(model: PyTree) -> PyTree:
    """Drop every adapter: the base model exactly as it was before ``apply_lora``."""
    layers = lora_layers(model, "unwrap_lora")
    return tree_apply({p: lambda m: m.base_layer for p in layers}, model, is_leaf=_is_lora)


def lora_params(model: PyTree) -> PyTree:
    """The adapters alone: ``model``'s structure with every array but the LoRA A/B
    matrices replaced by ``None`` (``edl.split``'s first half; ``edl.merge`` puts it back)."""
    lora_layers(model, "lora_params")
    return split(model, lora_trainable)[0]


def with_dropout_key(model: PyTree, key: PRNGKeyArray | None) -> PyTree:
    """``model`` whose LoRA layers draw dropout masks from ``key`` (one independent key per
    layer and stacked slice); ``None`` removes the keys (evaluation). Call it inside the loss
    function with a fresh key every step (e.g. one carried in the batch, or
    ``jax.random.fold_in(key, state.step)`` in a hand-written step); it is traceable."""
    layers = lora_layers(model, "with_dropout_key")
    keys = [None] * len(layers) if key is None else list(jax.random.split(key, len(layers)))

    def set_key(k: PRNGKeyArray | None):
        def one(layer: LoraLinear) -> LoraLinear:
            lead = leading_shape(layer)
            per_slice = None if k is None else jax.random.split(k, math.prod(lead)).reshape(lead)
            return eqx.tree_at(lambda m: m.dropout_key, layer, per_slice, is_leaf=is_none)

        return one

    fns = {p: set_key(k) for p, k in zip(layers, keys, strict=True)}
    return tree_apply(fns, model, is_leaf=_is_lora)
