"""LoRA as pure model -> model functions, with adapters in PEFT's file format.

    model = edl.lora.apply_lora(model, rank=8, alpha=16, key=jax.random.key(0))
    state = edl.create_state(model, tx, trainable=edl.lora.lora_trainable)  # A/B only
    ...                                             # train as usual (edl.train works as is)
    edl.lora.save_adapter(model, "adapter/")        # adapter_config.json +
                                                    # adapter_model.safetensors, for PEFT
    merged = edl.lora.merge_lora(model)             # W + (alpha/r) B A, adapters gone
    base = edl.lora.unwrap_lora(model)              # the untouched base model

``apply_lora`` wraps every linear layer whose path matches ``pattern`` in a ``LoraLinear``
(``edl.nn.lora``): the base keeps its arrays under ``<layer>.base_layer``, the adapters are
``<layer>.lora_A.weight (r, in)`` and ``<layer>.lora_B.weight (out, r)``, with the layer
axis in front in a layer stack. On a quantized model (``edl.quantize``) this is QLoRA.

PEFT files name adapters per layer (``base_model.model.model.layers.3.self_attn.q_proj
.lora_A.weight``); edl maps them through the model family's HF key table, the same one
``save_pretrained`` uses, so stacking and splitting layers is the table's business.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray, PyTree

from edl.io import hf
from edl.io.files import write_json_atomic
from edl.io.plan import plan_load
from edl.io.safetensors import CheckpointReader, save_file
from edl.models import registry
from edl.module import merge, split
from edl.nn.lora import LoraLinear, leading_shape
from edl.quantize import DEFAULT_PATTERN, is_linear
from edl.tree import compile_pattern, find, flatten, is_none, load_into, tree_apply

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_PATTERN",
    "LoraLinear",
    "apply_lora",
    "load_adapter",
    "lora_params",
    "lora_trainable",
    "merge_lora",
    "save_adapter",
    "unwrap_lora",
    "with_dropout_key",
]

lora_trainable = re.compile(r"(^|\.)lora_[AB]\.weight$")
"""``trainable=`` for ``edl.split`` / ``edl.create_state``: only the LoRA A/B matrices, so
gradients and optimizer state exist for nothing else."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model"  # + ".safetensors"
_PEFT_PREFIX = "base_model.model."
_PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS",
               "base": "FEATURE_EXTRACTION"}  # fmt: skip
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraLinear)


def _lora_layers(model: PyTree, what: str) -> dict[str, LoraLinear]:
    layers = find(model, _is_lora)
    if not layers:
        raise ValueError(f"{what}: the model has no LoRA adapters (edl.lora.apply_lora)")
    return layers


def _wrap(model: PyTree, plan: dict[str, tuple[int, float]], *, dropout: float | int,
          dtype: DTypeLike | None, key: PRNGKeyArray, what: str) -> PyTree:  # fmt: skip
    """``LoraLinear`` around the layers at ``plan``'s paths, ``path -> (rank, scaling)``."""
    layers = find(model, is_linear)
    unknown = sorted(set(plan) - set(layers))
    if unknown:
        raise ValueError(f"{what}: no linear layer at {unknown}; linear layers: {sorted(layers)}")
    wrapped = sorted(p for p in plan if _is_lora(layers[p]))
    if wrapped:
        raise ValueError(f"{what}: {wrapped} already carry LoRA adapters (unwrap_lora first)")
    keys = dict(zip(plan, jax.random.split(key, len(plan)), strict=True))

    def wrap(path: str):
        rank, scaling = plan[path]
        return lambda layer: LoraLinear.init(
            layer, rank=rank, scaling=scaling, dropout=dropout, dtype=dtype, key=keys[path]
        )

    return tree_apply({p: wrap(p) for p in plan}, model, is_leaf=is_linear)


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
    plan = dict.fromkeys(targets, (rank, alpha / rank))
    return _wrap(model, plan, dropout=dropout, dtype=dtype, key=key, what="apply_lora")


def merge_lora(model: PyTree) -> PyTree:
    """Fold every adapter into its base weight: ``W <- W + scaling * B @ A`` (in float32).
    The result has the structure of the model before ``apply_lora``; a quantized base is
    quantized again after merging."""
    layers = _lora_layers(model, "merge_lora")
    return tree_apply({p: LoraLinear.merge for p in layers}, model, is_leaf=_is_lora)


def unwrap_lora(model: PyTree) -> PyTree:
    """Drop every adapter: the base model exactly as it was before ``apply_lora``."""
    layers = _lora_layers(model, "unwrap_lora")
    return tree_apply({p: lambda m: m.base_layer for p in layers}, model, is_leaf=_is_lora)


def lora_params(model: PyTree) -> PyTree:
    """The adapters alone: ``model``'s structure with every array but the LoRA A/B
    matrices replaced by ``None`` (``edl.split``'s first half; ``edl.merge`` puts it back)."""
    _lora_layers(model, "lora_params")
    return split(model, lora_trainable)[0]


def with_dropout_key(model: PyTree, key: PRNGKeyArray | None) -> PyTree:
    """``model`` whose LoRA layers draw dropout masks from ``key`` (one independent key per
    layer and stacked slice); ``None`` removes the keys (evaluation). Call it inside the loss
    function with a fresh key every step (e.g. one carried in the batch, or
    ``jax.random.fold_in(key, state.step)`` in a hand-written step); it is traceable."""
    layers = _lora_layers(model, "with_dropout_key")
    keys = [None] * len(layers) if key is None else list(jax.random.split(key, len(layers)))

    def set_key(k: PRNGKeyArray | None):
        def one(layer: LoraLinear) -> LoraLinear:
            lead = leading_shape(layer)
            per_slice = None if k is None else jax.random.split(k, math.prod(lead)).reshape(lead)
            return eqx.tree_at(lambda m: m.dropout_key, layer, per_slice, is_leaf=is_none)

        return one

    fns = {p: set_key(k) for p, k in zip(layers, keys, strict=True)}
    return tree_apply(fns, model, is_leaf=_is_lora)


# -- PEFT files ----------------------------------------------------------------------------


def _table(model: PyTree, what: str) -> tuple[Any, str]:
    try:
        family, task = registry.family_of(model)
    except TypeError as e:
        raise TypeError(f"{what}: PEFT key names need a registered edl model class: {e}") from e
    return family.key_table_for(model.config), task


def _name(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _number(x: float) -> int | float:
    return round(x) if abs(x - round(x)) < 1e-9 else x


def _peft_config(model: PyTree, layers: dict[str, LoraLinear], task: str,
                 base_model_name_or_path: str | None) -> dict[str, Any]:  # fmt: skip
    """``adapter_config.json`` for ``layers``; PEFT targets modules by their last name, so
    every layer of one name must carry the same adapter shape and every linear layer of
    that name must be adapted."""
    by_name: dict[str, set[tuple[int, float, float]]] = collections.defaultdict(set)
    for path, layer in layers.items():
        by_name[_name(path)].add((layer.rank, layer.scaling, layer.dropout))
    mixed = {n: sorted(s) for n, s in by_name.items() if len(s) > 1}
    bare = sorted(p for p, x in find(model, is_linear).items()
                  if _name(p) in by_name and p not in layers)  # fmt: skip
    if mixed or bare:
        problems = [f"layers named {n} differ in (rank, scaling, dropout): {s}"
                    for n, s in mixed.items()]  # fmt: skip
        problems += [f"{p} shares its name with adapted layers but has no adapter" for p in bare]
        raise ValueError("save_adapter: PEFT targets modules by name, but " + "; ".join(problems))
    settings = {n: s.pop() for n, s in by_name.items()}
    dropouts = {d for _, _, d in settings.values()}
    if len(dropouts) > 1:
        raise ValueError(f"save_adapter: PEFT has one lora_dropout, layers use {dropouts}")
    rank = collections.Counter(r for r, _, _ in settings.values()).most_common(1)[0][0]
    alphas = {n: _number(s * r) for n, (r, s, _) in settings.items()}
    alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
    return {
        "peft_type": "LORA",
        "task_type": _PEFT_TASKS[task],
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(),
        "target_modules": sorted(settings),
        "rank_pattern": {n: r for n, (r, _, _) in settings.items() if r != rank},
        "alpha_pattern": {n: a for n, a in alphas.items() if a != alpha},
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


def save_adapter(
    model: PyTree, directory: str | os.PathLike[str], *, base_model_name_or_path: str | None = None
) -> Path:
    """Write the adapters as PEFT does: ``adapter_config.json`` + ``adapter_model.safetensors``
    (keys ``base_model.model.<HF module>.lora_A.weight``, one per layer), loadable by
    ``peft.PeftModel.from_pretrained`` on the HF base model. Files are written atomically."""
    layers = _lora_layers(model, "save_adapter")
    _, task = _table(model, "save_adapter")
    config = _peft_config(model, layers, task, base_model_name_or_path)
    tensors = {_PEFT_PREFIX + k: t for k, t in hf.export_state_dict(lora_params(model)).items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / f"{ADAPTER_WEIGHTS}.safetensors")
    write_json_atomic(directory / ADAPTER_CONFIG, config)
    return directory


# Config fields edl cannot honour; each must be absent or falsy.
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save",
                "layers_to_transform", "layer_replication", "target_parameters",
                "trainable_token_indices", "use_qalora", "alora_invocation_tokens")  # fmt: skip


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"load_adapter: {directory} has no {ADAPTER_CONFIG}")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"load_adapter: {file}: peft_type {config.get('peft_type')!r}, not LORA")
    bad = [k for k in _UNSUPPORTED if config.get(k)]
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config['bias']!r}")
    if bad:
        raise ValueError(f"load_adapter: {file}: unsupported PEFT options {bad}")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``peft.utils.get_pattern_key``)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    if r != rank:
        raise ValueError(f"load_adapter: {module}: adapter_config says r={r}, lora_A has {rank}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


class _Unprefixed:
    """The adapter file's tensors named without PEFT's ``base_model.model.`` prefix."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.names = {k.removeprefix(_PEFT_PREFIX): k for k in reader}

    def keys(self) -> list[str]:
        return list(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.info(self.names[name]).shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.reader.info(self.names[name]).dtype)

    def read_into(self, name: str, out: np.ndarray) -> None:
        self.reader.read_into(self.names[name], out)


def _adapter_plan(source: _Unprefixed, table: Any, config: dict[str, Any]) -> dict[str, Any]:
    """edl layer path -> (rank, scaling) of every adapted layer the file holds."""
    found: dict[str, set[tuple[int, float]]] = collections.defaultdict(set)
    for key in source.names:
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None or suffix == _SUFFIXES[1]:
            continue  # lora_B and strays are checked against the model by plan_load
        module = key.removesuffix(suffix)
        rank = source.shape(key)[0]
        path = table.to_edl(key)[0].path.removesuffix(suffix)
        found[path].add((rank, _scaling(config, module, rank)))
    mixed = {p: sorted(s) for p, s in found.items() if len(s) > 1}
    if mixed:
        raise ValueError(f"load_adapter: layers of one stack differ in (rank, scaling): {mixed}")
    return {p: s.pop() for p, s in found.items()}


def load_adapter(
    model: PyTree, directory: str | os.PathLike[str], *, dtype: DTypeLike | None = None
) -> PyTree:
    """``model`` (without adapters) with the PEFT LoRA adapter in ``directory`` applied.

    Reads ``adapter_config.json`` (``r``, ``lora_alpha``, ``rank_pattern``,
    ``alpha_pattern``, ``use_rslora``, ``lora_dropout``) and ``adapter_model.safetensors``;
    the layers to adapt are those the file holds tensors for. Full base weights that PEFT
    saves along with an adapted LM head or embedding (``lm_head.base_layer.weight``) replace
    the model's, as in PEFT. Every key is checked against the model before anything is
    loaded (missing, unexpected and mis-shaped keys raise one ``ValueError``). ``dtype`` of
    A/B: default the base weights'. Options edl cannot represent (DoRA, LoRA biases,
    ``modules_to_save``, ``layers_to_transform``, ...) raise.
    """
    directory = Path(directory)
    config = _read_config(directory)
    table, _ = _table(model, "load_adapter")
    with CheckpointReader(directory, prefix=ADAPTER_WEIGHTS) as reader:
        source = _Unprefixed(reader)
        plan = _adapter_plan(source, table, config)
        if not plan:
            raise ValueError(f"load_adapter: {reader.path} holds no lora_A tensors")
        model = _wrap(model, plan, dropout=float(config.get("lora_dropout") or 0.0),
                      dtype=dtype, key=jax.random.key(0), what="load_adapter")  # fmt: skip
        bases = [table.to_edl(k)[0].path for k in source.names if k.endswith(".base_layer.weight")]
        loaded = "|".join([lora_trainable.pattern, *(f"^{re.escape(p)}$" for p in bases)])
        like, rest = split(model, loaded)
        targets = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in flatten(like).items()}
        try:
            plan = plan_load(table, targets, source)
        except ValueError as e:
            where = f"{reader.path} (keys after {_PEFT_PREFIX!r})"
            raise ValueError(f"load_adapter: {where}: {e}") from None
        arrays = {}
        for path, target in targets.items():
            arrays[path] = np.empty(target.shape, source.dtype(plan.first_key(path)))
            plan.read(path, arrays[path])
    return merge(load_into(like, arrays), rest)
