"""Declarative Hugging Face <-> edl key tables, one per model family, used both ways.

A rule pairs a HF key template with an edl path template. ``{layer}`` (HF side only) is a
layer index: the tensors of all layers stack along the leading axis of one edl array.
``{name}`` matches any dotted remainder. The first matching rule wins, in either direction::

    LLAMA = KeyTable(
        rules=(("model.layers.{layer}.{name}", "model.layers.{name}"), ("{name}", "{name}")),
    )
    LLAMA.to_edl("model.layers.3.mlp.up_proj.weight")  # ("model.layers.mlp.up_proj.weight", 3)
    LLAMA.to_hf("model.layers.mlp.up_proj.weight", 3)   # "model.layers.3.mlp.up_proj.weight"
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["KeyRule", "KeyTable"]

_FIELDS = {"layer": r"(?P<layer>\d+)", "name": r"(?P<name>.+?)"}


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{layer\}|\{name\})", template)
    body = "".join(_FIELDS[p[1:-1]] if p in ("{layer}", "{name}") else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """``hf`` and ``edl`` templates; the rule is *stacked* when ``hf`` has ``{layer}``."""

    hf: str
    edl: str

    def __post_init__(self) -> None:
        if "{layer}" in self.edl:
            raise ValueError(f"key rule {self}: only the HF template may contain {{layer}}")
        if ("{name}" in self.hf) != ("{name}" in self.edl):
            raise ValueError(f"key rule {self}: {{name}} must appear on both sides or neither")

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.hf


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """Ordered key rules plus HF keys to ignore on load (regexes, e.g. stale RoPE buffers)."""

    rules: tuple[KeyRule | tuple[str, str], ...]
    ignore_hf: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rules = tuple(r if isinstance(r, KeyRule) else KeyRule(*r) for r in self.rules)
        object.__setattr__(self, "rules", rules)

    def to_edl(self, hf_key: str) -> tuple[str, int | None]:
        """``(edl_path, layer index or None)`` for a HF key; ``KeyError`` if no rule matches."""
        for rule in self.rules:
            m = _template_regex(rule.hf).match(hf_key)
            if m:
                path = rule.edl.replace("{name}", m["name"]) if "{name}" in rule.edl else rule.edl
                return path, (int(m["layer"]) if rule.stacked else None)
        raise KeyError(f"no key rule maps the HF key {hf_key!r}")

    def is_stacked(self, edl_path: str) -> bool:
        """Whether ``edl_path`` holds all layers (its first axis is the layer axis)."""
        return self._edl_rule(edl_path)[0].stacked

    def to_hf(self, edl_path: str, layer: int | None = None) -> str:
        """The HF key of ``edl_path`` (of layer ``layer`` for a stacked path)."""
        rule, name = self._edl_rule(edl_path)
        if rule.stacked != (layer is not None):
            raise ValueError(
                f"{edl_path!r} is {'' if rule.stacked else 'not '}stacked: "
                f"{'pass' if rule.stacked else 'do not pass'} a layer index"
            )
        key = rule.hf.replace("{name}", name) if name is not None else rule.hf
        return key.replace("{layer}", str(layer)) if rule.stacked else key

    def ignored(self, hf_key: str) -> bool:
        return any(re.fullmatch(p, hf_key) for p in self.ignore_hf)

    def _edl_rule(self, edl_path: str) -> tuple[KeyRule, str | None]:
        for rule in self.rules:
            m = _template_regex(rule.edl).match(edl_path)
            if m:
                return rule, (m["name"] if "{name}" in rule.edl else None)
        raise KeyError(f"no key rule maps the edl path {edl_path!r}")
