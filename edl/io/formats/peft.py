"""LoRA adapters in PEFT's file format: ``save_adapter`` / ``load_adapter``.

    model = edl.lora.apply_lora(model, rank=8, alpha=16, key=jax.random.key(0))
    ...                                              # train
    save_adapter(model, "adapter/")                  # adapter_config.json +
                                                     # adapter_model.safetensors, for PEFT
    model = load_adapter(base, "adapter/")           # PEFT's own adapters load the same way

PEFT files name adapters per layer (``base_model.model.model.layers.3.self_attn.q_proj
.lora_A.weight``); edl maps them through the model family's HF key table, the same one
``save_pretrained`` uses, so stacking and splitting layers is the table's business, and
loads them through ``edl.io.formats.plan`` like every other loader. Adapters on MoE expert
weights (PEFT's ``target_parameters``) are ``edl.io.formats.peft_experts``. The LoRA layers
themselves (``apply_lora``, ``merge_lora``, ...) are ``edl.lora``, a layer below: it knows
no files.
"""

from __future__ import annotations

import collections
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl.io.formats.files import read_json, write_json_atomic
from edl.io.formats.hf import ADAPTER_CONFIG, export_state_dict
from edl.io.formats.manifest import Manifest, describe
from edl.io.formats.peft_experts import expert_config, expert_tensors, load_experts, plan_experts
from edl.io.formats.plan import TensorSource, load_arrays, plan_load
from edl.io.formats.safetensors import CheckpointReader, save_file
from edl.lora import lora_experts, lora_params, lora_trainable, wrap_lora
from edl.models.keymap import KeyTable
from edl.module import merge, split
from edl.nn.lora import LoraLinear, leading_shape
from edl.nn.lora_experts import LoraExperts
from edl.nn.moe import SparseMoE
from edl.quantize import is_linear
from edl.tree import find, flatten, load_into

__all__ = [
    "load_adapter",
    "save_adapter",
]

ADAPTER_WEIGHTS = "adapter_model"  # + ".safetensors"
PEFT_PREFIX = "base_model.model."
_PEFT_TASKS = {
    "causal_lm": "CAUSAL_LM",
    "sequence_classification": "SEQ_CLS",
    "conditional_generation": "CAUSAL_LM",
    "with_projection": "FEATURE_EXTRACTION",
    "base": "FEATURE_EXTRACTION",
}
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_BASE_SUFFIX = ".base_layer.weight"


def _table(manifest: Manifest, what: str) -> tuple[KeyTable, str]:
    """The HF module-name table and the task of the model ``manifest`` describes."""
    try:
        table = manifest.module_table()
    except TypeError as e:
        raise TypeError(f"{what}: PEFT key names need a registered edl model class: {e}") from e
    assert manifest.task is not None  # a registered model has one
    return table, manifest.task


def _name(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _number(x: float) -> int | float:
    return round(x) if abs(x - round(x)) < 1e-9 else x


def _settings(layers: dict[str, LoraLinear]) -> dict[str, tuple[int, float, float]]:
    return {p: (layer.rank, layer.scaling, layer.dropout) for p, layer in layers.items()}


def _targeting(
    model: PyTree, layers: dict[str, LoraLinear], table: KeyTable
) -> dict[str, tuple[int, float, float]]:
    """PEFT's ``target_modules`` names with each one's (rank, scaling, dropout).

    PEFT matches a listed name against a module's whole name or its last dotted parts, so
    the short names (``q_proj``) do when every layer of one name carries the same adapter
    shape and every linear layer of that name is adapted; otherwise each adapted module
    is listed by its whole HF name (``model.layers.3.self_attn.q_proj``, one per stacked
    layer), which targets exactly it."""
    by_name: dict[str, set[tuple[int, float, float]]] = collections.defaultdict(set)
    for path, setting in _settings(layers).items():
        by_name[_name(path)].add(setting)
    bare = any(_name(p) in by_name and p not in layers for p in find(model, is_linear))
    if not bare and all(len(s) == 1 for s in by_name.values()):
        return {n: s.pop() for n, s in by_name.items()}
    return {
        _Modules.name(table, path, tuple(int(i) for i in index)): setting
        for path, setting in _settings(layers).items()
        for index in np.ndindex(*leading_shape(layers[path]))
    }


def _peft_config(
    model: PyTree,
    layers: dict[str, LoraLinear],
    table: KeyTable,
    task: str,
    base_model_name_or_path: str | None,
    revision: str | None = None,
) -> dict[str, Any]:
    """``adapter_config.json`` for ``layers`` (see :func:`_targeting`); the most common rank
    and alpha are ``r`` / ``lora_alpha``, the others go in ``rank_pattern`` /
    ``alpha_pattern``. PEFT has one ``lora_dropout``, so adapters must share theirs (and it
    must be 0 with adapters on expert weights, ``target_parameters``)."""
    settings = _targeting(model, layers, table) if layers else {}
    parameters = expert_config(model, table)
    dropouts = {d for _, _, d in settings.values()} | ({0.0} if parameters else set())
    if len(dropouts) > 1:
        raise ValueError(
            f"save_adapter: PEFT has one lora_dropout (none on expert weights), layers use "
            f"{dropouts}"
        )
    every = {**settings, **{n: (r, s, 0.0) for n, (r, s) in parameters.items()}}
    rank = collections.Counter(r for r, _, _ in every.values()).most_common(1)[0][0]
    alphas = {n: _number(s * r) for n, (r, s, _) in every.items()}
    alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
    config = {
        "peft_type": "LORA",
        "task_type": _PEFT_TASKS[task],
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(),
        "target_modules": sorted(settings),
        "target_parameters": sorted(parameters) or None,
        "rank_pattern": {n: r for n, (r, _, _) in every.items() if r != rank},
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
        "revision": revision,
    }
    _check_patterns(config, {n: (r, s) for n, (r, s, _) in every.items()})
    return config


def _check_patterns(config: dict[str, Any], settings: dict[str, tuple[int, float]]) -> None:
    """PEFT looks each module's rank and alpha up in the patterns by suffix, so a pattern
    for one name can catch another (``down_proj`` catches ``experts.down_proj``): refuse a
    config that PEFT would read differently from what the adapters are."""
    wrong = {
        n: (want, got)
        for n, want in settings.items()
        if not math.isclose((got := _rank_and_scaling(config, n))[1], want[1]) or got[0] != want[0]
    }
    if wrong:
        raise ValueError(
            f"save_adapter: PEFT would read other (rank, scaling) from the config for "
            f"{wrong} (name: (adapter's, PEFT's)); give these adapters distinct names or settings"
        )


def save_adapter(
    model: PyTree,
    directory: str | os.PathLike[str],
    *,
    base_model_name_or_path: str | None = None,
    dtype: DTypeLike | None = None,
    manifest: Manifest | None = None,
    revision: str | None = None,
) -> Path:
    """Write the adapters as PEFT does: ``adapter_config.json`` + ``adapter_model.safetensors``
    (keys ``base_model.model.<HF module>.lora_A.weight``, one per layer), loadable by
    ``peft.PeftModel.from_pretrained`` on the HF base model. ``dtype`` casts A and B on the
    way out. Files are written atomically.

    Written beside the base model's own files (``save_pretrained``), the directory is what
    transformers calls a model with an embedded adapter: with peft installed,
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the base and applies the
    adapter. Raises ``ValueError`` when the adapters differ in dropout (PEFT has one).
    ``manifest``: ``model``'s (``edl.io.formats.manifest.describe``), computed when not
    given. ``base_model_name_or_path`` and ``revision`` (a hub commit) say where PEFT and
    transformers find the base model (``AutoModelForCausalLM.from_pretrained(directory)``
    of a directory holding only the adapter loads the base from there)."""
    params = lora_params(model)  # raises when the model has no adapters
    layers = find(model, lambda x: isinstance(x, LoraLinear))
    table, task = _table(manifest or describe(model), "save_adapter")
    config = _peft_config(model, layers, table, task, base_model_name_or_path, revision)
    tensors = {}
    if layers:
        without_experts = jax.tree.map(
            lambda x: None if isinstance(x, LoraExperts) else x,
            params,
            is_leaf=lambda x: isinstance(x, LoraExperts),
        )
        tensors = export_state_dict(without_experts, dtype=dtype, key_table=table)
        tensors = {PEFT_PREFIX + k: t for k, t in tensors.items()}
    if lora_experts(model):
        tensors |= expert_tensors(model, table, PEFT_PREFIX, dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / f"{ADAPTER_WEIGHTS}.safetensors")
    write_json_atomic(directory / ADAPTER_CONFIG, config)
    return directory


# Config fields edl cannot honour; each must be absent or falsy.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "layers_to_transform",
    "layer_replication",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
)
# PEFT runs ``init_lora_weights`` on every targeted layer when it loads an adapter. These
# leave the base weights alone; the first three also leave lora_B zero, so a targeted layer
# the file has no tensors for adds nothing. Any other (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA)
# rewrites the base weights from them, which edl does not reproduce.
_B_ZERO_INITS = (True, "gaussian", "eva")
_BASE_KEEPING_INITS = (*_B_ZERO_INITS, False, "orthogonal", "mica")
# ``target_modules: null`` is filled from PEFT's per-model_type defaults
# (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``); qwen3_moe has none there.
_DEFAULT_TARGETS = {
    t: ("q_proj", "v_proj")
    for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral")
}
_ALL_LINEAR = "all-linear"


def _init_name(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"load_adapter: {directory} has no {ADAPTER_CONFIG}")
    config = read_json(file, what="adapter config")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"load_adapter: {file}: peft_type {config.get('peft_type')!r}, not LORA")
    bad = [k for k in _UNSUPPORTED if config.get(k)]
    if config.get("bias", "none") != "none":
        bad.append(f"bias={config['bias']!r}")
    init = _init_name(config.get("init_lora_weights", True))
    if init not in _BASE_KEEPING_INITS:
        bad.append(
            f"init_lora_weights={config['init_lora_weights']!r} (PEFT re-derives the "
            "base weights from it when loading)"
        )
    if bad:
        raise ValueError(f"load_adapter: {file}: unsupported PEFT options {bad}")
    for field, what in (("r", "the LoRA rank"), ("lora_alpha", "the LoRA scale numerator")):
        value = config.get(field)
        if value is None:
            raise ValueError(f"load_adapter: {file}: no {field!r} ({what}); PEFT writes it")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(
                f"load_adapter: {file}: {field} must be a positive number, got {value!r}"
            )
    if isinstance(config["r"], float):
        raise ValueError(f"load_adapter: {file}: r must be an integer, got {config['r']!r}")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``peft.utils.get_pattern_key``)."""
    key = _pattern_key(patterns, module)
    return default if key is None else patterns[key]


def _pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)


def _rank_and_scaling(config: dict[str, Any], module: str) -> tuple[int, float]:
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _selects(spec: str | list[str], name: str) -> bool:
    """PEFT's ``target_modules`` / ``exclude_modules`` test of a module name: a string is a
    regex that must match the whole name; a list holds names that must equal it or end it
    after a dot (``check_target_module_exists``)."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith(f".{s}") for s in spec)


class _Modules:
    """The model's modules as PEFT sees them in the HF model: every HF module name and, for
    the linear layers PEFT and edl can both adapt, where each one lives in edl (layer path
    and stack index). MoE routers are linear layers in edl but not ``nn.Linear`` in
    transformers (5), so PEFT neither adapts them nor counts them as "all-linear"."""

    def __init__(self, model: PyTree, table: KeyTable) -> None:
        moe = find(model, lambda x: isinstance(x, SparseMoE))
        routers = {f"{m}.gate" for m in moe}
        self.linear: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path, layer in find(model, is_linear).items():
            for index in np.ndindex(*leading_shape(layer)):
                index = tuple(int(i) for i in index)
                if path not in routers:
                    self.linear[self.name(table, path, index)] = (path, index)
        self.names = {""}
        for path, leaf in flatten(model).items():
            module = path.rpartition(".")[0]
            if not hasattr(leaf, "shape") or not module:
                continue
            depth = table.stack_depth(f"{module}{_SUFFIXES[0]}")
            for index in np.ndindex(*leaf.shape[:depth]):
                parts = self.name(table, module, tuple(int(i) for i in index)).split(".")
                self.names.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))

    @staticmethod
    def name(table: KeyTable, path: str, index: tuple[int, ...]) -> str:
        """The HF module name of edl's ``path`` (a module) at stack ``index``: through the
        key table, as its adapter keys are named."""
        return table.to_hf(f"{path}{_SUFFIXES[0]}", index or None).removesuffix(_SUFFIXES[0])


def _targets(
    config: dict[str, Any],
    modules: _Modules,
    *,
    task: str,
    model_type: str,
    head: str | None,
    file: Path,
) -> set[str]:
    """The HF names of the layers PEFT puts adapters on: ``target_modules`` (a list, a regex,
    ``"all-linear"`` or ``null`` for the model type's default) less ``exclude_modules``;
    PEFT's errors and warnings."""
    spec = config.get("target_modules")
    parameters = bool(config.get("target_parameters"))
    if spec is None and parameters:
        spec = []  # PEFT: target_parameters alone adapts no module
    if spec is None:
        if model_type not in _DEFAULT_TARGETS:
            raise ValueError(
                f"load_adapter: {file}: no target_modules, and PEFT has no default "
                f"for model_type {model_type!r}"
            )
        spec = list(_DEFAULT_TARGETS[model_type])
    if isinstance(spec, str) and spec.lower() == _ALL_LINEAR:
        skip = {head} if head is not None else set()
        if task == "sequence_classification" and config.get("task_type") == "SEQ_CLS":
            skip.add("score")
        spec = sorted(set(modules.linear) - skip)
    exclude = config.get("exclude_modules")
    targeted, excluded, unmatched, unsupported = set(), [], [], []
    for name in sorted(modules.names):
        if exclude and _selects(exclude, name):
            excluded.append(name)
        elif not _selects(spec, name):
            unmatched.append(name)
        elif name in modules.linear:
            targeted.add(name)
        else:
            unsupported.append(name or "<the whole model>")
    if unsupported:
        raise ValueError(
            f"load_adapter: {file}: target_modules {spec!r} selects modules that are not linear "
            f"layers PEFT adapts (it rejects these, but for embeddings, which edl does not "
            f"adapt; MoE routers are no nn.Linear in transformers): {unsupported}"
        )
    if not targeted and not parameters:
        if excluded and not unmatched:
            why = "every module is excluded by exclude_modules"
        elif not excluded:
            why = f"target_modules {spec!r} matches no module of the model"
        else:
            why = f"target_modules {spec!r} less exclude_modules {exclude!r} leaves no module"
        raise ValueError(f"load_adapter: {file}: {why}; linear layers: {sorted(modules.linear)}")
    if exclude and not excluded:
        warnings.warn(
            f"load_adapter: {file}: exclude_modules {exclude!r} excludes no module", stacklevel=3
        )
    for field in ("rank_pattern", "alpha_pattern"):
        keys = config.get(field) or {}
        unused = sorted(k for k in keys if not any(_pattern_key({k: 0}, m) for m in targeted))
        if unused:
            warnings.warn(
                f"load_adapter: {file}: {field} keys match no targeted module and are "
                f"ignored (as in PEFT): {unused}",
                stacklevel=3,
            )
    return targeted


def _listing(names: list[str], limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def _split_key(key: str) -> tuple[str, str] | None:
    """``(module, suffix)`` of an adapter-file key with a suffix edl reads, else None."""
    for suffix in (*_SUFFIXES, _BASE_SUFFIX):
        if key.endswith(suffix):
            return key.removesuffix(suffix), suffix
    return None


def _adapted_layers(
    config: dict[str, Any],
    modules: _Modules,
    targeted: set[str],
    shapes: dict[str, tuple[int, ...]],
    weights: Path,
) -> tuple[dict[str, tuple[int, float]], dict[str, str]]:
    """``(layers, keys)``: edl layer path -> (rank, scaling) of every layer to wrap, and the
    file's keys to load (HF name -> stored key), from the file's tensor ``shapes``. Warns
    about what PEFT leaves out or initialises itself, raises where edl cannot build PEFT's
    model."""
    present: dict[str, dict[str, str]] = collections.defaultdict(dict)
    ignored, strays = [], []
    for key in shapes:
        name = key.removeprefix(PEFT_PREFIX)
        split_key = _split_key(name)
        module = None if split_key is None else split_key[0]
        if module in targeted:
            present[module][split_key[1]] = key
        elif split_key is None and any(name.startswith(f"{t}.") for t in targeted):
            strays.append(key)
        else:
            ignored.append(key)
    if strays:
        raise ValueError(
            f"load_adapter: {weights}: tensors edl cannot read for targeted "
            f"modules: {sorted(strays)}"
        )
    if ignored:
        warnings.warn(
            f"load_adapter: {weights}: {len(ignored)} tensors of modules that "
            f"target_modules does not select are ignored, as PEFT ignores them: "
            f"{_listing(ignored)}",
            stacklevel=3,
        )
    init = _init_name(config.get("init_lora_weights", True))
    # PEFT keeps its own initialisation of what the file lacks: lora_B = 0 makes lora_A moot.
    no_b = sorted(m for m in targeted if _SUFFIXES[1] not in present[m])
    no_a = sorted(m for m in targeted if _SUFFIXES[0] not in present[m] and m not in no_b)
    if no_a or (no_b and init not in _B_ZERO_INITS):
        raise ValueError(
            f"load_adapter: {weights}: targeted modules without lora_A {_listing(no_a)} / "
            f"lora_B {_listing(no_b)}: PEFT keeps its own random initialisation there "
            f"(init_lora_weights={config.get('init_lora_weights', True)!r}), which edl cannot "
            f"reproduce"
        )
    if no_b:
        warnings.warn(
            f"load_adapter: {weights}: no adapter tensors for the targeted modules "
            f"{_listing(no_b)}: they get lora_B = 0 (adding nothing), as PEFT "
            f"initialises them",
            stacklevel=3,
        )
    by_stack: dict[str, set[tuple[int, float]]] = collections.defaultdict(set)
    for module in sorted(targeted):  # the wrapped layers' order draws their lora_A: fixed
        rank, scaling = _rank_and_scaling(config, module)
        if _SUFFIXES[0] in present[module] and _SUFFIXES[1] in present[module]:
            stored = shapes[present[module][_SUFFIXES[0]]][0]
            if stored != rank:
                raise ValueError(
                    f"load_adapter: {weights}: {module}: adapter_config says "
                    f"r={rank}, the file's lora_A has {stored}"
                )
        by_stack[modules.linear[module][0]].add((rank, float(scaling)))
    mixed = {p: sorted(s) for p, s in by_stack.items() if len(s) > 1}
    if mixed:
        raise ValueError(f"load_adapter: layers of one stack differ in (rank, scaling): {mixed}")
    layers = {p: s.pop() for p, s in by_stack.items()}
    untargeted = sorted(
        n for n, (p, _) in modules.linear.items() if p in layers and n not in targeted
    )
    if untargeted:
        warnings.warn(
            f"load_adapter: edl stacks layers, so the stacked layers "
            f"{_listing(untargeted)}, which PEFT leaves without adapters, get ones "
            f"with lora_B = 0 (the same outputs)",
            stacklevel=3,
        )
    keys = {}
    for module, found in present.items():
        if _SUFFIXES[1] in found:  # without lora_B the module starts from zero (warned)
            keys.update({module + s: k for s, k in found.items()})
        elif _BASE_SUFFIX in found:
            keys[module + _BASE_SUFFIX] = found[_BASE_SUFFIX]
    return layers, keys


def load_adapter(
    model: PyTree, directory: str | os.PathLike[str], *, dtype: DTypeLike | None = None
) -> PyTree:
    """``model`` (without adapters) with the PEFT LoRA adapter in ``directory`` applied: the
    model ``peft.PeftModel.from_pretrained`` builds from the same files.

    Reads ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``, ``rank_pattern``, ``alpha_pattern``, ``use_rslora``,
    ``lora_dropout``, ``init_lora_weights``) and ``adapter_model.safetensors``. The layers
    adapted are those PEFT targets, matched against the HF module names
    (``model.layers.3.self_attn.q_proj``): a list names modules exactly or by their last
    dotted parts, a string is a regex matching the whole name, ``"all-linear"`` is every
    linear layer but the output head (and MoE routers, not ``nn.Linear`` in transformers),
    ``null`` the model type's PEFT default (q_proj, v_proj), or none when
    ``target_parameters`` is set; ``exclude_modules`` (list or regex) removes modules.
    ``target_parameters`` adapts MoE expert weights (``experts.gate_up_proj``; PEFT's nested
    keys and shapes, ``edl.io.formats.peft_experts``). As in PEFT, the file's tensors for
    modules not targeted are ignored (with a warning), and a targeted module the file has no
    tensors for starts from PEFT's initialisation, lora_B = 0, so it adds nothing (a
    warning; an error where that initialisation is random). Full base weights that PEFT
    saves along with an adapted LM head (``lm_head.base_layer.weight``) replace the model's,
    as in PEFT. edl stacks the layers of a model, so a stack where PEFT adapts only some
    layers gets zero adapters on the others (same outputs, warned).

    Every key is checked against the model before anything is loaded (missing, unexpected
    and mis-shaped keys raise one ``ValueError``). ``dtype`` of A/B: default the base
    weights'. Options edl cannot represent (DoRA, LoRA biases, ``modules_to_save``,
    ``layers_to_transform``, base-rewriting initialisations such as PiSSA, ...) raise, as
    does a config without ``r`` or ``lora_alpha``.
    """
    directory = Path(directory)
    config = _read_config(directory)
    manifest = describe(model)
    table, task = _table(manifest, "load_adapter")
    file = directory / ADAPTER_CONFIG
    modules = _Modules(model, table)
    head = "lm_head" if task == "causal_lm" else None
    assert manifest.config is not None  # _table refused an unregistered model
    model_type = manifest.config["model_type"]
    targeted = _targets(config, modules, task=task, model_type=model_type, head=head, file=file)
    with CheckpointReader(directory, prefix=ADAPTER_WEIGHTS) as reader:
        shapes = {k: tuple(reader.info(k).shape) for k in reader}
        experts = plan_experts(
            config, model, table, shapes, PEFT_PREFIX, reader.path, _rank_and_scaling
        )
        shapes = {k: v for k, v in shapes.items() if k not in experts.claimed}
        if targeted:
            model = _load_linear(model, config, modules, targeted, shapes, table, reader, dtype)
        return load_experts(model, experts, reader, dtype)


def _load_linear(
    model: PyTree,
    config: dict[str, Any],
    modules: _Modules,
    targeted: set[str],
    shapes: dict[str, tuple[int, ...]],
    table: KeyTable,
    reader: CheckpointReader,
    dtype: DTypeLike | None,
) -> PyTree:
    """``load_adapter``'s part for linear layers (``target_modules``), the file's expert
    adapters' keys taken out of ``shapes``."""
    layers, keys = _adapted_layers(config, modules, targeted, shapes, reader.path)
    model = wrap_lora(
        model,
        layers,
        dropout=float(config.get("lora_dropout") or 0.0),
        dtype=dtype,
        key=jax.random.key(0),
        what="load_adapter",
    )
    bases = [table.to_edl(k)[0].path for k in keys if k.endswith(_BASE_SUFFIX)]
    loaded = "|".join([lora_trainable.pattern, *(f"^{re.escape(p)}$" for p in bases)])
    like, rest = split(model, loaded)
    targets = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in flatten(like).items()}
    own = {}
    for path, x in flatten(like).items():
        for index in np.ndindex(*x.shape[: table.stack_depth(path)]):
            name = table.to_hf(path, tuple(int(i) for i in index) or None)
            if name not in keys:
                own[name] = np.asarray(x[index])
    # The file's tensors for the targeted layers, and for every adapted slot the file
    # does not fill the freshly wrapped model's own value (lora_A as drawn, lora_B zero).
    source = TensorSource.from_reader(reader, keys) | TensorSource.from_mapping(own)
    try:
        plan = plan_load(table, targets, source)
    except ValueError as e:
        where = f"{reader.path} (keys after {PEFT_PREFIX!r})"
        raise ValueError(f"load_adapter: {where}: {e}") from None
    arrays = load_arrays(plan, flatten(like))  # cast to like's dtypes, placed as like
    return merge(load_into(like, arrays), rest)
