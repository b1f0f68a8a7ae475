"""The table of model families: which edl classes build which Hugging Face checkpoints.

A ``Family`` bundles a config class, its declarative HF key table and one model class per
task; ``register`` files it under the HF ``model_type``s it covers. ``resolve`` turns a
``config.json`` dict (and optionally a task) into the family, config and class to build, and
``architecture`` names the HF class to write back into ``config.json``.

This module imports no model module, so a model built from other families (LLaVA's language
model) looks them up here without importing ``edl.models.registry``, which imports every
model module and registers edl's families (``edl.models`` imports it, so the table is full
whenever a model module is loaded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx

from edl.models.keymap import KeyTable

__all__ = [
    "TASKS",
    "Family",
    "architecture",
    "family_for",
    "family_of",
    "register",
    "registered",
    "resolve",
]

# task name -> HF architecture suffix
TASKS = {
    "causal_lm": "ForCausalLM",
    "sequence_classification": "ForSequenceClassification",
    "conditional_generation": "ForConditionalGeneration",
    "with_projection": "ModelWithProjection",
    "base": "Model",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """``config_cls.from_hf(dict)`` reads configs; ``tasks`` maps task -> model class (the
    first is the default); ``hf_names`` maps each covered ``model_type`` to its HF class
    prefix ("Llama"). ``key_table``: the family's table, or a function of the config giving
    it (a model whose parts come from other families: LLaVA's language model).
    ``architectures``: task -> HF class name where it is not the prefix + the task's suffix
    (Gemma 3's text model: ``Gemma3ForCausalLM`` but ``Gemma3TextModel``)."""

    name: str
    config_cls: type
    key_table: KeyTable | Callable[[Any], KeyTable]
    tasks: Mapping[str, type]
    hf_names: Mapping[str, str]
    task_tables: Mapping[str, KeyTable] = dataclasses.field(default_factory=dict)
    module_table: Callable[[Any], KeyTable] | None = None
    architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def architecture_for(self, model_type: str, task: str) -> str:
        """The HF class name of ``task``'s model of ``model_type`` (``"Qwen2ForCausalLM"``)."""
        return self.architectures.get(task) or self.hf_names[model_type] + TASKS[task]

    def module_table_for(self, config: Any, model_cls: type | None = None) -> KeyTable:
        """The table of HF's in-memory module names (PEFT adapters name modules): the file
        table unless the family's files use other names (LLaVA's, under transformers 5)."""
        if self.module_table is not None:
            return self.module_table(config)
        return self.key_table_for(config, model_cls)

    def key_table_for(self, config: Any, model_cls: type | None = None) -> KeyTable:
        """The key table for ``config`` (and, where a task lays its keys out its own way,
        ``model_cls``: CLIP's ``...WithProjection`` towers): bound to its layer groups
        (mixed dense / MoE stacks), or built from it."""
        for task, table in self.task_tables.items():
            if model_cls is self.tasks[task]:
                return table
        if not isinstance(self.key_table, KeyTable):
            return self.key_table(config)
        return self.key_table.with_layer_groups(getattr(config, "layer_groups", None))


_BY_MODEL_TYPE: dict[str, Family] = {}

# Model types close to a supported family that edl refuses, and what they lack (the error
# names it rather than only listing what edl builds).
UNSUPPORTED = {
    "gemma3n": "Gemma 3n's per-layer embeddings, AltUp, LAuReL and activation sparsity are "
    "not implemented",
}


def _unsupported(model_type: Any) -> ValueError:
    reason = UNSUPPORTED.get(model_type) if isinstance(model_type, str) else None
    why = f": {reason}" if reason else ""
    return ValueError(
        f"unsupported model_type {model_type!r}{why}; edl builds {sorted(_BY_MODEL_TYPE)}"
    )


def register(family: Family) -> Family:
    """File ``family`` under each of its model types (a later registration wins)."""
    unknown = set(family.tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"family {family.name!r}: unknown tasks {sorted(unknown)}")
    for model_type in family.hf_names:
        _BY_MODEL_TYPE[model_type] = family
    return family


def _task_of_architecture(arch: str) -> str | None:
    # Longest suffix first: "ForCausalLM" before "Model".
    for task, suffix in sorted(TASKS.items(), key=lambda kv: -len(kv[1])):
        if arch.endswith(suffix):
            return task
    return None


def resolve(hf_config: Mapping[str, Any], task: str | None = None) -> tuple[Family, Any, type]:
    """``(family, config, model_class)`` for a HF ``config.json`` dict.

    ``task`` defaults to the one named by ``architectures[0]`` (else the family's first:
    ``"causal_lm"`` for decoders).
    """
    if not isinstance(hf_config, Mapping):
        raise ValueError(
            f"config.json must hold a JSON object, got {type(hf_config).__name__} {hf_config!r:.80}"
        )
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"config.json: {_unsupported(model_type)}")
    family = _BY_MODEL_TYPE[model_type]
    if task is None:
        archs = hf_config.get("architectures") or []
        task = (_task_of_architecture(archs[0]) if archs else None) or next(iter(family.tasks))
    if task not in family.tasks:
        raise ValueError(
            f"{model_type!r} models have no task {task!r}; available: {sorted(family.tasks)}"
        )
    return family, family.config_cls.from_hf(hf_config), family.tasks[task]


def family_for(model_type: str) -> Family:
    """The family registered for a HF ``model_type`` (``ValueError`` naming the known ones)."""
    if model_type not in _BY_MODEL_TYPE:
        raise _unsupported(model_type)
    return _BY_MODEL_TYPE[model_type]


def family_of(model: eqx.Module) -> tuple[Family, str]:
    """``(family, task)`` of a model instance."""
    for family in registered():
        for task, cls in family.tasks.items():
            if type(model) is cls:
                return family, task
    raise TypeError(f"{type(model).__name__} is not a registered edl model class")


def architecture(model: eqx.Module) -> str:
    """The HF architecture name (``"Qwen2ForCausalLM"``) of a model instance."""
    family, task = family_of(model)
    return family.architecture_for(model.config.model_type, task)


def registered() -> tuple[Family, ...]:
    """Every registered family, once each, in the order registered."""
    return tuple({id(f): f for f in _BY_MODEL_TYPE.values()}.values())
