"""What a model is, apart from its arrays: :class:`Manifest`, computed once from a model by
:func:`describe` and handed to every writer, stored in a checkpoint's ``state.json``
(``"manifest"``) and turned back into a model skeleton by :func:`rebuild`.

A manifest names the model's family (``edl.models.registry``), task, Hugging Face
architecture and edl class, holds its ``config.json`` dict and its layer structure (which
linear layers carry LoRA adapters or are quantized, with their settings:
``edl.io.formats.structure``). The family's key tables follow from it
(:meth:`Manifest.key_table`) and are not stored. A plain pytree that no family knows has
``family``, ``task``, ``architecture`` and ``config`` ``None``.

In ``state.json``::

    "manifest": {
      "family": "llama", "task": "causal_lm", "architecture": "LlamaForCausalLM",
      "model_class": "LlamaForCausalLM",
      "config": {"model_type": "llama", "hidden_size": 32, ...},
      "layer_structure": {"model.layers.self_attn.q_proj": {"lora": {...}}, ...}
    }

Checkpoints written before the manifest existed hold ``config.json`` and ``"layers"``
instead; :meth:`Manifest.from_hf_config` derives the same manifest from those.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from edl.io.formats import structure
from edl.models import registry
from edl.models.keymap import KeyTable

__all__ = ["Manifest", "describe", "rebuild"]

LayerStructure = Mapping[str, Mapping[str, Mapping[str, Any]]]
"""``edl path -> {"lora": {...}, "quantized": {...}}`` (``structure.layer_structure``)."""

_TEXT_FIELDS = ("family", "task", "architecture", "model_class")
_LAYER_KINDS = ("lora", "quantized")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a model is, JSON-serialisable (:meth:`to_json` / :meth:`from_json`).

    Attributes:
        family: the ``edl.models.registry`` family's name (``"llama"``), or ``None`` for a
            plain pytree no family knows.
        task: the family's task (``"causal_lm"``, ...), or ``None``.
        architecture: the Hugging Face class name ``config.json`` records
            (``"LlamaForCausalLM"``), or ``None``.
        model_class: the edl class's name (``type(model).__name__``); ``None`` where
            unknown (a plain model of a checkpoint written before manifests).
        config: the ``config.json`` dict (``config.to_hf(architectures=[architecture])``),
            or ``None``.
        layer_structure: every LoRA-wrapped or quantized linear layer with its settings
            (``edl.io.formats.structure.layer_structure``; ``{}`` for a plain model).
    """

    family: str | None
    task: str | None
    architecture: str | None
    model_class: str | None
    config: Mapping[str, Any] | None
    layer_structure: LayerStructure
    # (family, edl config, class) of the model described, or resolved from ``config`` on
    # first use; not part of the manifest's value.
    _resolved: tuple[registry.Family, Any, type] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def registered(self) -> bool:
        """Whether a registered family builds the model (it has Hugging Face files)."""
        return self.family is not None

    @property
    def lora_targets(self) -> dict[str, Mapping[str, Any]]:
        """edl path -> LoRA settings (rank, scaling, dropout, dtype) of each adapted layer."""
        return {p: e["lora"] for p, e in self.layer_structure.items() if "lora" in e}

    @property
    def quantized_layers(self) -> dict[str, Mapping[str, Any]]:
        """edl path -> quantization settings (format, block size, dtypes) of each layer."""
        return {p: e["quantized"] for p, e in self.layer_structure.items() if "quantized" in e}

    def without(self, kind: str) -> Manifest:
        """This manifest with no layer of ``kind`` (``"lora"``: merged or unwrapped;
        ``"quantized"``: dequantized)."""
        if kind not in _LAYER_KINDS:
            raise ValueError(f"Manifest.without: kind must be one of {_LAYER_KINDS}, got {kind!r}")
        kept = {
            p: {k: v for k, v in e.items() if k != kind} for p, e in self.layer_structure.items()
        }
        return dataclasses.replace(self, layer_structure={p: e for p, e in kept.items() if e})

    def resolve(self) -> tuple[registry.Family, Any, type]:
        """``(family, edl config, model class)``; ``TypeError`` for an unregistered model."""
        if self.family is None or self.config is None:
            raise TypeError(f"{self.model_class} is not a registered edl model class")
        if self._resolved is None:
            family, config, model_cls = registry.resolve(self.config, self.task)
            if family.name != self.family:
                raise ValueError(
                    f"manifest: family {self.family!r}, but its config's model_type "
                    f"{self.config.get('model_type')!r} is family {family.name!r}'s"
                )
            object.__setattr__(self, "_resolved", (family, config, model_cls))
        assert self._resolved is not None
        return self._resolved

    def key_table(self) -> KeyTable:
        """The family's HF <-> edl key table for this config and class (its files' names)."""
        family, config, model_cls = self.resolve()
        return family.key_table_for(config, model_cls)

    def module_table(self) -> KeyTable:
        """The table of HF's in-memory module names (PEFT adapters name modules)."""
        family, config, model_cls = self.resolve()
        return family.module_table_for(config, model_cls)

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON object (``state.json``'s ``"manifest"``)."""
        return {
            **{name: getattr(self, name) for name in _TEXT_FIELDS},
            "config": None if self.config is None else dict(self.config),
            "layer_structure": {p: dict(e) for p, e in self.layer_structure.items()},
        }

    @classmethod
    def from_json(cls, data: object, *, where: str = "manifest") -> Manifest:
        """The manifest :meth:`to_json` wrote; ``ValueError`` naming ``where`` and the field
        when ``data`` is not one."""
        fields = {*_TEXT_FIELDS, "config", "layer_structure"}
        if not isinstance(data, dict) or set(data) != fields:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"{where}: expected an object with the fields {sorted(fields)}, got {got}"
            )
        for name in _TEXT_FIELDS:
            if data[name] is not None and not isinstance(data[name], str):
                raise ValueError(f"{where}.{name}: expected a string or null, got {data[name]!r}")
        if data["config"] is not None and not isinstance(data["config"], dict):
            raise ValueError(
                f"{where}.config: expected an object or null, got {data['config']!r:.80}"
            )
        _check_layers(data["layer_structure"], f"{where}.layer_structure")
        if (data["family"] is None) != (data["config"] is None):
            raise ValueError(f"{where}: family and config must both be set or both be null")
        return cls(**{name: data[name] for name in fields})

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], layers: LayerStructure, *, where: str = "config.json"
    ) -> Manifest:
        """The manifest of the model a ``config.json`` dict builds (``registry.resolve``: the
        task from ``architectures``), with ``layers`` (``state.json``'s ``"layers"``): what
        a checkpoint written before manifests says. Its ``config`` is the edl config's
        ``to_hf`` (what a writer of the model writes), the config built from the file's."""
        _check_layers(layers, f"{where} 'layers'")
        family, edl_config, model_cls = registry.resolve(config)
        task = next(t for t, c in family.tasks.items() if c is model_cls)
        architecture = family.architecture_for(edl_config.model_type, task)
        return cls(
            family=family.name,
            task=task,
            architecture=architecture,
            model_class=model_cls.__name__,
            config=_json_config(edl_config, architecture),
            layer_structure=layers,
            _resolved=(family, edl_config, model_cls),
        )


def _check_layers(layers: object, where: str) -> None:
    if not isinstance(layers, dict) or not all(
        isinstance(p, str) and isinstance(e, dict) and set(e) <= set(_LAYER_KINDS)
        for p, e in layers.items()
    ):
        raise ValueError(
            f"{where}: expected an object of layer path -> {{'lora': ..., 'quantized': ...}}, "
            f"got {layers!r:.120}"
        )


def _json_config(config: Any, architecture: str) -> dict[str, Any]:
    """``config.json``'s dict of an edl config, as JSON reads it back (lists, not tuples)."""
    return json.loads(json.dumps(config.to_hf(architectures=[architecture])))


def describe(model: PyTree) -> Manifest:
    """The manifest of ``model`` (a registered edl model class, LoRA-wrapped and quantized
    or not, abstract or concrete; or any other pytree: ``family`` ``None``)."""
    layers = structure.layer_structure(model)
    try:
        family, task = registry.family_of(model)
    except TypeError:
        return Manifest(None, None, None, type(model).__name__, None, layers)
    architecture = registry.architecture(model)
    return Manifest(
        family=family.name,
        task=task,
        architecture=architecture,
        model_class=type(model).__name__,
        config=_json_config(model.config, architecture),
        layer_structure=layers,
        _resolved=(family, model.config, type(model)),
    )


def rebuild(manifest: Manifest, *, where: str = "rebuild") -> PyTree:
    """The abstract model (``jax.ShapeDtypeStruct`` arrays, ``eqx.filter_eval_shape``) that
    ``manifest`` describes: the family's class built from its config, with the layers of
    its layer structure quantized and wrapped in LoRA adapters. Errors name ``where``."""
    if not manifest.registered:
        raise ValueError(
            f"{where}: the manifest describes a {manifest.model_class}, which no registered "
            "family builds"
        )
    _, config, model_cls = manifest.resolve()

    def build() -> PyTree:
        model = model_cls.init(config, key=jax.random.key(0))
        return structure.rebuild(model, manifest.layer_structure, where=where)

    return eqx.filter_eval_shape(build)
