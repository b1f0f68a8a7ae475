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

With ``target_parameters`` (PEFT's ``LoraConfig`` field of that name) it adapts MoE expert
weights, stored as 3-D arrays rather than linear layers: ``<experts>`` becomes a
``LoraExperts`` (``edl.nn.lora_experts``) holding ``<experts>.base_layer`` and, per HF parameter
(``gate_up_proj``, ``down_proj``), ``<experts>.adapters.<name>.lora_A.weight (r * experts, in)``
and ``lora_B.weight (out, r * experts)``, PEFT's own shapes.

Adapters in PEFT's file format (``save_adapter`` / ``load_adapter``) are ``edl.io.formats.peft``:
files sit a layer above model surgery, and this module reaches nothing above it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray, PyTree

from edl.module import split
from edl.nn.lora import LoraLinear, leading_shape
from edl.nn.lora_experts import EXPERT_PARAMS, LoraExperts, wrap_experts
from edl.quantize import DEFAULT_PATTERN, is_linear
from edl.tree import compile_pattern, find, is_none, tree_apply

__all__ = [
    "DEFAULT_PATTERN",
    "apply_lora",
    "expert_parameters",
    "lora_experts",
    "lora_layers",
    "lora_params",
    "lora_trainable",
    "merge_lora",
    "unwrap_lora",
    "with_dropout_key",
    "wrap_expert_lora",
    "wrap_lora",
]

lora_trainable = re.compile(r"(^|\.)lora_[AB]\.weight$")
"""``trainable=`` for ``edl.split`` / ``edl.create_state``: only the LoRA A/B matrices, so
gradients and optimizer state exist for nothing else."""


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraLinear)


def _is_experts(x: Any) -> bool:
    return type(x) in EXPERT_PARAMS


def _is_lora_experts(x: Any) -> bool:
    return isinstance(x, LoraExperts)


def lora_experts(model: PyTree) -> dict[str, LoraExperts]:
    """Every expert module with adapters on its weights (``LoraExperts``) by path."""
    return find(model, _is_lora_experts)


def expert_parameters(model: PyTree) -> dict[str, str]:
    """The expert weights LoRA can adapt, as PEFT names them after the module:
    ``"<edl experts path>.<HF parameter>"`` (``"model.layers.mlp.experts.gate_up_proj"``;
    edl stacks layers, so no layer index) -> the experts module's path."""
    return {
        f"{path}.{name}": path
        for path, experts in find(model, _is_experts).items()
        for name in EXPERT_PARAMS[type(experts)]
    }


def _adapted(model: PyTree, what: str) -> tuple[dict[str, LoraLinear], dict[str, LoraExperts]]:
    layers, experts = find(model, _is_lora), lora_experts(model)
    if not layers and not experts:
        raise ValueError(f"{what}: the model has no LoRA adapters (edl.lora.apply_lora)")
    return layers, experts


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


def wrap_expert_lora(
    model: PyTree,
    params: Mapping[str, Mapping[str, tuple[int, float]]],
    *,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
    what: str = "wrap_expert_lora",
) -> PyTree:
    """Adapters on expert weights: ``params`` maps an experts module's path to its HF
    parameters' ``(rank, scaling)`` (``{"model.layers.mlp.experts": {"down_proj": (8, 2.0)}}``);
    each such module becomes a ``LoraExperts``. Errors name the caller, ``what``."""
    experts = find(model, lambda x: _is_experts(x) or _is_lora_experts(x))
    unknown = sorted(set(params) - set(experts))
    if unknown:
        raise ValueError(f"{what}: no MoE experts at {unknown}; experts: {sorted(experts)}")
    wrapped = sorted(p for p in params if _is_lora_experts(experts[p]))
    if wrapped:
        raise ValueError(f"{what}: {wrapped} already carry LoRA adapters (unwrap_lora first)")
    keys = dict(zip(params, jax.random.split(key, len(params)), strict=True))

    def wrap(path: str):
        return lambda e: wrap_experts(e, dict(params[path]), dtype=dtype, key=keys[path])

    return tree_apply({p: wrap(p) for p in params}, model, is_leaf=_is_experts)


def _select_parameters(model: PyTree, targets: Sequence[str]) -> dict[str, list[str]]:
    """PEFT's ``target_parameters`` match (a name equals the target or ends with ``.`` +
    target) over :func:`expert_parameters`: experts path -> HF parameter names."""
    if isinstance(targets, str):
        raise TypeError("apply_lora: target_parameters is a list of names, as in PEFT")
    available = expert_parameters(model)
    chosen: dict[str, list[str]] = {}
    for target in targets:
        hits = [n for n in available if n == target or n.endswith(f".{target}")]
        if not hits:
            raise ValueError(
                f"apply_lora: target_parameters entry {target!r} matches no expert weight; "
                f"the model's: {sorted(available) or 'none (no MoE experts)'}"
            )
        for name in hits:
            chosen.setdefault(available[name], []).append(name.rpartition(".")[2])
    return chosen


def apply_lora(
    model: PyTree,
    *,
    rank: int,
    alpha: float | int,
    pattern: str | re.Pattern[str] | None = None,
    target_parameters: Sequence[str] | None = None,
    use_rslora: bool = False,
    dropout: float | int = 0.0,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
) -> PyTree:
    """Wrap the linear layers whose path matches ``pattern`` in LoRA adapters, and adapt
    the MoE expert weights ``target_parameters`` names.

    Each matched layer computes ``W x + (alpha / rank) B A x`` with ``A (rank, in)`` drawn
    as PEFT does and ``B (out, rank)`` zero, so the model's outputs are unchanged until B
    is trained. Stacked layers get one adapter per layer (leading axis).

    Args:
        rank, alpha: LoRA's ``r`` and ``lora_alpha``.
        pattern: regex searched in layer paths (``"model.layers.self_attn.q_proj"``);
            default :data:`DEFAULT_PATTERN`, the attention and MLP projections, or no linear
            layer at all when ``target_parameters`` is given (PEFT's ``target_modules=[]``).
        target_parameters: PEFT's field of that name: expert weights by HF parameter name,
            matched as PEFT matches them against ``<experts path>.<name>`` (``["experts
            .gate_up_proj", "experts.down_proj"]``; :func:`expert_parameters` lists them).
            A name that matches none raises ``ValueError`` naming it.
        use_rslora: scale by ``alpha / sqrt(rank)`` (rsLoRA) instead of ``alpha / rank``.
        dropout: dropout rate on the adapters' input; it applies only under
            :func:`with_dropout_key` (training), never silently inside generation. PEFT has
            none for expert weights: nonzero with ``target_parameters`` raises.
        dtype: of A and B; default the base weight's dtype (a quantized base's original).
        key: for A.
    """
    if rank < 1:
        raise ValueError(f"apply_lora: rank must be >= 1, got {rank}")
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    key_experts = jax.random.fold_in(key, 1)  # the linear layers draw from key, as before
    if target_parameters is not None:
        if dropout:
            raise ValueError(f"apply_lora: PEFT has no dropout on expert weights, got {dropout}")
        chosen = _select_parameters(model, target_parameters)
        params = {p: dict.fromkeys(names, (rank, scaling)) for p, names in chosen.items()}
        model = wrap_expert_lora(model, params, dtype=dtype, key=key_experts, what="apply_lora")
        if pattern is None:
            return model
    regex = compile_pattern(DEFAULT_PATTERN if pattern is None else pattern)
    targets = find(model, is_linear, regex)
    if not targets:
        raise ValueError(
            f"apply_lora: pattern {regex.pattern!r} matches none of the linear layers "
            f"{sorted(find(model, is_linear))}"
        )
    layers = dict.fromkeys(targets, (rank, scaling))
    return wrap_lora(model, layers, dropout=dropout, dtype=dtype, key=key, what="apply_lora")


def _is_wrapper(x: Any) -> bool:
    return _is_lora(x) or _is_lora_experts(x)


def merge_lora(model: PyTree) -> PyTree:
    """Fold every adapter into its base weight: ``W <- W + scaling * B @ A`` (in float32;
    per expert for expert weights). The result has the structure of the model before
    ``apply_lora``; a quantized base is quantized again after merging."""
    layers, experts = _adapted(model, "merge_lora")
    fns = dict.fromkeys([*layers, *experts], lambda m: m.merge())
    return tree_apply(fns, model, is_leaf=_is_wrapper)


def unwrap_lora(model: PyTree) -> PyTree:
    """Drop every adapter: the base model exactly as it was before ``apply_lora``."""
    layers, experts = _adapted(model, "unwrap_lora")
    fns = dict.fromkeys([*layers, *experts], lambda m: m.base_layer)
    return tree_apply(fns, model, is_leaf=_is_wrapper)


def lora_params(model: PyTree) -> PyTree:
    """The adapters alone: ``model``'s structure with every array but the LoRA A/B
    matrices replaced by ``None`` (``edl.split``'s first half; ``edl.merge`` puts it back)."""
    _adapted(model, "lora_params")
    return split(model, lora_trainable)[0]


def with_dropout_key(model: PyTree, key: PRNGKeyArray | None) -> PyTree:
    """``model`` whose LoRA layers draw dropout masks from ``key`` (one independent key per
    layer and stacked slice); ``None`` removes the keys (evaluation). Call it inside the loss
    function with a fresh key every step (e.g. one carried in the batch, or
    ``jax.random.fold_in(key, state.step)`` in a hand-written step); it is traceable.
    Adapters on expert weights have no dropout (as in PEFT)."""
    layers, _ = _adapted(model, "with_dropout_key")
    if not layers:
        return model
    keys = [None] * len(layers) if key is None else list(jax.random.split(key, len(layers)))

    def set_key(k: PRNGKeyArray | None):
        def one(layer: LoraLinear) -> LoraLinear:
            lead = leading_shape(layer)
            per_slice = None if k is None else jax.random.split(k, math.prod(lead)).reshape(lead)
            return eqx.tree_at(lambda m: m.dropout_key, layer, per_slice, is_leaf=is_none)

        return one

    fns = {p: set_key(k) for p, k in zip(layers, keys, strict=True)}
    return tree_apply(fns, model, is_leaf=_is_lora)
