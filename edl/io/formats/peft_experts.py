"""PEFT adapter files for LoRA on MoE expert weights (``LoraConfig(target_parameters=...)``),
both ways; ``edl.io.formats.peft`` calls these for the ``target_parameters`` part of a file.

PEFT wraps each adapted parameter of a module in a ``ParamWrapper``, nesting one wrapper per
parameter in the order transformers registers them (``gate_up_proj`` before ``down_proj``):
the last one's adapter is ``<module>.lora_A.weight``, the one before it
``<module>.base_layer.lora_A.weight``, and so on. Which key holds which parameter therefore
depends on the set adapted in that module, computed here per layer. Shapes and the delta:
``edl.nn.lora_experts``.
"""

from __future__ import annotations

import collections
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl.io.formats.safetensors import CheckpointReader
from edl.lora import lora_experts, wrap_expert_lora
from edl.models.keymap import KeyTable
from edl.nn.lora_experts import EXPERT_PARAMS, LoraExperts, hf_shape
from edl.tree import find, named_map

__all__ = ["expert_config", "expert_tensors", "expert_weights", "load_experts", "plan_experts"]

_A, _B = ".lora_A.weight", ".lora_B.weight"
_NEST = ".base_layer"


def _module(table: KeyTable, path: str, index: tuple[int, ...]) -> str:
    """The HF module name of edl's experts ``path`` at layer ``index``."""
    return table.to_hf(f"{path}{_A}", index or None).removesuffix(_A)


def _keys(module: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """PEFT's (lora_A, lora_B) keys of each of ``names`` (in transformers' order), the
    adapted parameters of one module."""
    nest = {name: module + _NEST * (len(names) - 1 - k) for k, name in enumerate(names)}
    return {name: (m + _A, m + _B) for name, m in nest.items()}


def _indices(lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in ix) for ix in np.ndindex(*lead)]


def _base(x: Any) -> Any:
    return x.base_layer if isinstance(x, LoraExperts) else x


def expert_weights(model: PyTree, table: KeyTable) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Every expert weight PEFT can target, by its HF name (``model.layers.3.mlp.experts
    .down_proj``) -> (edl experts path, HF parameter, layer index)."""
    where = lambda x: type(_base(x)) in EXPERT_PARAMS
    out = {}
    for path, experts in find(model, where).items():
        base = _base(experts)
        for name in EXPERT_PARAMS[type(base)]:
            for index in _indices(hf_shape(base, name)[:-3]):
                out[f"{_module(table, path, index)}.{name}"] = (path, name, index)
    return out


def expert_config(model: PyTree, table: KeyTable) -> dict[str, tuple[int, float]]:
    """``target_parameters`` names with each one's (rank, scaling): ``experts.<param>`` when
    every expert module of that name carries the same adapter on it, else one entry per
    layer's module (``model.layers.3.mlp.experts.down_proj``)."""
    full: dict[str, tuple[int, float]] = {}
    for path, experts in lora_experts(model).items():
        for name, param in experts.adapters.items():
            rank = param.rank_experts // experts.num_experts
            for index in _indices(param.lora_A.weight.shape[:-2]):
                full[f"{_module(table, path, index)}.{name}"] = (rank, param.scaling)
    short: dict[str, set[tuple[int, float]]] = collections.defaultdict(set)
    for name, setting in full.items():
        short[".".join(name.split(".")[-2:])].add(setting)
    everything = expert_weights(model, table)
    covered = all(n in full for n in everything if any(n.endswith(f".{s}") for s in short))
    if covered and all(len(s) == 1 for s in short.values()):
        return {n: s.pop() for n, s in short.items()}
    return full


def expert_tensors(
    model: PyTree, table: KeyTable, prefix: str, dtype: DTypeLike | None
) -> dict[str, np.ndarray]:
    """The expert adapters' tensors under PEFT's keys (``prefix`` + key)."""
    out = {}
    for path, experts in lora_experts(model).items():
        # jax keeps a dict's keys sorted: transformers' order comes from the table
        names = [n for n in EXPERT_PARAMS[type(experts.base_layer)] if n in experts.adapters]
        for index in _indices(next(iter(experts.adapters.values())).lora_A.weight.shape[:-2]):
            keys = _keys(_module(table, path, index), names)
            for name, (key_a, key_b) in keys.items():
                param = experts.adapters[name]
                for key, factor in ((key_a, param.lora_A), (key_b, param.lora_B)):
                    x = np.asarray(factor.weight[index])
                    out[prefix + key] = x if dtype is None else x.astype(dtype)
    return out


class ExpertPlan:
    """What a file's ``target_parameters`` adapt: ``params`` (experts path -> HF parameter
    -> (rank, scaling)) and ``keys`` ((path, parameter, layer index) -> (lora_A key,
    lora_B key)), for :func:`load_experts`."""

    def __init__(self) -> None:
        self.params: dict[str, dict[str, tuple[int, float]]] = {}
        self.keys: dict[tuple[str, str, tuple[int, ...]], tuple[str, str]] = {}

    @property
    def claimed(self) -> set[str]:
        return {k for pair in self.keys.values() for k in pair}


def plan_experts(
    config: dict[str, Any],
    model: PyTree,
    table: KeyTable,
    shapes: dict[str, tuple[int, ...]],
    prefix: str,
    file: Path,
    rank_and_scaling: Callable[[dict[str, Any], str], tuple[int, float]],
) -> ExpertPlan:
    """Match ``config["target_parameters"]`` as PEFT does (a parameter's HF name equals an
    entry or ends with ``.`` + entry), check the file's keys and shapes. ``ValueError``
    naming the entry when none matches anything (a warning for one stale entry among
    others, which PEFT ignores), naming the key when one is missing or mis-shaped.
    ``rank_and_scaling(config, name)``: PEFT's rank / alpha pattern lookup."""
    targets = list(config.get("target_parameters") or [])
    if not targets:
        return ExpertPlan()
    if config.get("lora_dropout"):
        raise ValueError(f"load_adapter: {file}: PEFT allows no lora_dropout on target_parameters")
    per_module: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    hits: dict[str, int] = dict.fromkeys(targets, 0)
    weights = expert_weights(model, table)
    for full, (path, name, index) in weights.items():  # in transformers' order per module
        matched = [t for t in targets if full == t or full.endswith(f".{t}")]
        for t in matched:
            hits[t] += 1
        if matched:
            per_module.setdefault((path, index), []).append(name)
    available = sorted(weights)
    experts = find(model, lambda x: type(x) in EXPERT_PARAMS)
    stale = [t for t, n in hits.items() if not n]
    if stale and len(stale) == len(targets):
        raise ValueError(
            f"load_adapter: {file}: target_parameters {stale} match no expert weight of the "
            f"model; its expert weights: {available[:12] or 'none (no MoE experts)'}"
        )
    if stale:
        warnings.warn(
            f"load_adapter: {file}: target_parameters {stale} match no expert weight "
            f"(ignored, as PEFT ignores them)",
            stacklevel=3,
        )
    plan = ExpertPlan()
    settings: dict[tuple[str, str], set[tuple[int, float]]] = collections.defaultdict(set)
    for (path, index), names in per_module.items():
        module = _module(table, path, index)
        e = experts[path]
        for name, (key_a, key_b) in _keys(module, names).items():
            rank, scaling = rank_and_scaling(config, f"{module}.{name}")
            settings[(path, name)].add((rank, float(scaling)))
            n_exp, d1, d2 = hf_shape(e, name)[-3:]
            fan_in, fan_out = (d1, d2) if EXPERT_PARAMS[type(e)][name].transposed else (d2, d1)
            want = {key_a: (rank * n_exp, fan_in), key_b: (fan_out, rank * n_exp)}
            for key, shape in want.items():
                got = shapes.get(prefix + key)
                if got is None:
                    raise ValueError(f"load_adapter: {file}: no tensor {prefix + key} ({name})")
                if tuple(got) != shape:
                    raise ValueError(
                        f"load_adapter: {file}: {prefix + key} ({name}, r={rank}, {n_exp} "
                        f"experts) has shape {tuple(got)}, expected {shape}"
                    )
            plan.keys[(path, name, index)] = (prefix + key_a, prefix + key_b)
    mixed = {f"{p}.{n}": sorted(s) for (p, n), s in settings.items() if len(s) > 1}
    if mixed:
        raise ValueError(f"load_adapter: layers of one stack differ in (rank, scaling): {mixed}")
    for (path, name), s in settings.items():
        plan.params.setdefault(path, {})[name] = s.pop()
    modules = {_module(table, p, i) for p, i in per_module}
    nested = re.compile(rf"({re.escape(_NEST)})*\.lora_[AB]\.weight$")
    strays = [
        k
        for k in shapes
        if k not in plan.claimed and nested.sub("", k.removeprefix(prefix)) in modules
    ]
    if strays:
        raise ValueError(
            f"load_adapter: {file}: tensors of adapted expert modules that the targeted "
            f"parameters do not name (PEFT nests one wrapper per parameter): {sorted(strays)}"
        )
    return plan


def load_experts(
    model: PyTree, plan: ExpertPlan, reader: CheckpointReader, dtype: DTypeLike | None
) -> PyTree:
    """``model`` with ``plan``'s expert adapters, filled from ``reader``; layers of a stack
    that the file does not adapt get lora_B = 0 (the same outputs, warned)."""
    if not plan.params:
        return model
    model = wrap_expert_lora(
        model, plan.params, dtype=dtype, key=jax.random.key(0), what="load_adapter"
    )
    arrays: dict[str, np.ndarray] = {}
    unfilled = []
    for path, experts in lora_experts(model).items():
        if path not in plan.params:
            continue
        for name, param in experts.adapters.items():
            a, b = np.array(param.lora_A.weight), np.array(param.lora_B.weight)
            for index in _indices(a.shape[:-2]):
                keys = plan.keys.get((path, name, index))
                if keys is None:
                    unfilled.append(f"{path}.{name}{list(index)}")
                    continue
                a[index], b[index] = reader.read(keys[0]), reader.read(keys[1])
            base = f"{path}.adapters.{name}"
            arrays[f"{base}{_A}"], arrays[f"{base}{_B}"] = a, b
    if unfilled:
        warnings.warn(
            f"load_adapter: edl stacks layers, so {unfilled}, which PEFT leaves without "
            f"adapters, get ones with lora_B = 0 (the same outputs)",
            stacklevel=3,
        )
    return named_map(lambda p, x: jnp.asarray(arrays[p], x.dtype) if p in arrays else x, model)
