"""Declarative Hugging Face <-> edl key tables, one per model family, used both ways.

A rule pairs a HF key template with an edl path template. ``{name}`` matches any dotted
remainder. ``{layer}`` and ``{expert}`` (HF side only) are *stacking* indices: the tensors of
all layers (and all experts) stack along the leading axes of one edl array, layer axis
first. The first matching rule wins, in either direction::

    TABLE = KeyTable(rules=(
        ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
         "model.layers.mlp.experts.gate_proj"),                 # (layers, experts, out, in)
        ("model.layers.{layer}.{name}", "model.layers.{name}"),  # (layers, ...)
        ("{name}", "{name}"),
    ))
    TABLE.to_edl("model.layers.3.mlp.up_proj.weight")
    # (Placement("model.layers.mlp.up_proj.weight", (3,)),)
    TABLE.to_hf("model.layers.mlp.experts.gate_proj", (3, 5))
    # "model.layers.3.mlp.experts.5.gate_proj.weight"

A rule with several edl templates reads one *fused* HF tensor into several edl arrays, each
an equal chunk along ``split`` (transformers 5 keeps MoE experts as one
``experts.gate_up_proj`` tensor of ``(experts, 2 * intermediate, dim)``); such rules only
load, and saving always writes the per-tensor layout of the other rules (EasyDeL's
``ParameterTransformRule``).

Models whose layers are not all alike (Qwen3-MoE's dense ``mlp_only_layers`` between MoE
layers) keep one stack per kind of layer; ``with_layer_groups`` binds a table to the per-layer
group names so that HF layer ``i`` lands at its position within its group's stack.
"""

from __future__ import annotations

import dataclasses
import functools
import re

__all__ = ["KeyRule", "KeyTable", "Placement"]

_STACK_AXES = ("layer", "expert")
_FIELDS = {"layer": r"(?P<layer>\d+)", "expert": r"(?P<expert>\d+)", "name": r"(?P<name>.+?)"}
_LAYERS = "layers"  # the path component of the (default) layer stack


@functools.cache
def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{layer\}|\{expert\}|\{name\})", template)
    body = "".join(
        _FIELDS[p[1:-1]] if p[1:-1] in _FIELDS and p[0] == "{" else re.escape(p) for p in parts
    )
    return re.compile(f"^{body}$")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one HF tensor goes: ``path[index]`` (``index`` over the leading stacked axes) is
    the tensor, or its chunk ``part = (axis, k, parts)``: the ``k``-th of ``parts`` equal
    pieces along the HF tensor's ``axis``."""

    path: str
    index: tuple[int, ...] = ()
    part: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """``hf`` and ``edl`` templates. ``{layer}``/``{expert}`` in ``hf`` stack along the edl
    array's leading axes in that order. Several ``edl`` templates make a rule that splits the
    HF tensor along ``split`` into equal chunks, one per template. ``load_only`` rules (those
    with ``split`` too) read an alternative layout; saving uses the other rules."""

    hf: str
    edl: str | tuple[str, ...]
    split: int | None = None
    load_only: bool = False

    def __post_init__(self) -> None:
        if self.split is not None:
            object.__setattr__(self, "load_only", True)
        edls = self.edl_templates
        if any("{layer}" in e or "{expert}" in e for e in edls):
            raise ValueError(f"key rule {self}: only the HF template may hold {{layer}}/{{expert}}")
        if any(("{name}" in self.hf) != ("{name}" in e) for e in edls):
            raise ValueError(f"key rule {self}: {{name}} must appear on both sides or neither")
        if (len(edls) > 1) != (self.split is not None):
            raise ValueError(f"key rule {self}: a split axis goes with several edl templates")
        hf = self.hf
        if "{expert}" in hf and "{layer}" in hf and hf.index("{expert}") < hf.index("{layer}"):
            raise ValueError(f"key rule {self}: {{layer}} must come before {{expert}}")

    @property
    def edl_templates(self) -> tuple[str, ...]:
        return (self.edl,) if isinstance(self.edl, str) else tuple(self.edl)

    @property
    def axes(self) -> tuple[str, ...]:
        """The stacking placeholders of the HF template, in the edl array's axis order."""
        return tuple(a for a in _STACK_AXES if "{" + a + "}" in self.hf)


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """Ordered key rules, HF keys to ignore on load (regexes, e.g. stale RoPE buffers), and
    optionally the group (stack field name) of every layer, see ``with_layer_groups``."""

    rules: tuple[KeyRule | tuple, ...]
    ignore_hf: tuple[str, ...] = ()
    layer_groups: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        rules = tuple(r if isinstance(r, KeyRule) else KeyRule(*r) for r in self.rules)
        object.__setattr__(self, "rules", rules)

    def with_layer_groups(self, groups: tuple[str, ...] | None) -> KeyTable:
        """This table for a model whose layer ``i`` lives in the stack ``groups[i]`` (a path
        component replacing ``"layers"``) at its rank among the layers of that group.
        ``None``, or every layer in ``"layers"``, is the plain single stack."""
        if groups is not None and all(g == _LAYERS for g in groups):
            groups = None
        return dataclasses.replace(self, layer_groups=None if groups is None else tuple(groups))

    # -- HF -> edl ------------------------------------------------------------------------

    def to_edl(self, hf_key: str) -> tuple[Placement, ...]:
        """Where the HF tensor ``hf_key`` goes (several placements for a fused tensor);
        ``KeyError`` if no rule maps it."""
        for rule in self.rules:
            m = _template_regex(rule.hf).match(hf_key)
            if not m:
                continue
            index = tuple(int(m[a]) for a in rule.axes)
            templates = rule.edl_templates
            out = []
            for k, template in enumerate(templates):
                path = template.replace("{name}", m["name"]) if "{name}" in template else template
                part = None if rule.split is None else (rule.split, k, len(templates))
                path, idx = self._to_group(path, index, rule)
                out.append(Placement(path, idx, part))
            return tuple(out)
        raise KeyError(f"no key rule maps the HF key {hf_key!r}")

    def ignored(self, hf_key: str) -> bool:
        return any(re.fullmatch(p, hf_key) for p in self.ignore_hf)

    # -- edl -> HF ------------------------------------------------------------------------

    def stack_depth(self, edl_path: str) -> int:
        """How many leading axes of ``edl_path`` are stacking axes (0, 1 layer, 2 +expert)."""
        return len(self._edl_rule(edl_path)[0].axes)

    def is_stacked(self, edl_path: str) -> bool:
        """Whether ``edl_path`` holds all layers (its first axis is the layer axis)."""
        return self.stack_depth(edl_path) > 0

    def to_hf(self, edl_path: str, index: int | tuple[int, ...] | None = None) -> str:
        """The HF key of ``edl_path[index]`` (``index``: layer, or (layer, expert), over the
        stacking axes; ``None`` for an unstacked path)."""
        rule, name, _ = self._edl_rule(edl_path)
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        if len(index) != len(rule.axes):
            raise ValueError(
                f"{edl_path!r} is stacked over {rule.axes or 'nothing'}: pass "
                f"{len(rule.axes)} indices, got {index}"
            )
        index = self._from_group(edl_path, index, rule)
        key = rule.hf.replace("{name}", name) if name is not None else rule.hf
        for axis, i in zip(rule.axes, index, strict=True):
            key = key.replace("{" + axis + "}", str(i))
        return key

    def _edl_rule(self, edl_path: str) -> tuple[KeyRule, str | None, str]:
        plain = self._ungrouped(edl_path)
        for rule in self.rules:
            if rule.load_only:
                continue
            m = _template_regex(rule.edl).match(plain)
            if m:
                return rule, (m["name"] if "{name}" in rule.edl else None), plain
        raise KeyError(f"no key rule maps the edl path {edl_path!r}")

    # -- layer groups ---------------------------------------------------------------------

    def _to_group(self, path: str, index: tuple[int, ...], rule: KeyRule):
        parts = path.split(".")
        if self.layer_groups is None or "layer" not in rule.axes or _LAYERS not in parts:
            return path, index
        layer = index[0]
        if layer >= len(self.layer_groups):
            return path, index  # reported as unexpected by the loader
        group = self.layer_groups[layer]
        parts[parts.index(_LAYERS)] = group
        local = self.layer_groups[:layer].count(group)
        return ".".join(parts), (local, *index[1:])

    def _ungrouped(self, path: str) -> str:
        if self.layer_groups is None:
            return path
        parts = path.split(".")
        for i, p in enumerate(parts):
            if p in self.layer_groups:
                parts[i] = _LAYERS
                return ".".join(parts)
        return path

    def _from_group(self, path: str, index: tuple[int, ...], rule: KeyRule) -> tuple[int, ...]:
        if self.layer_groups is None or "layer" not in rule.axes:
            return index
        group = next((p for p in path.split(".") if p in self.layer_groups), None)
        if group is None:
            return index
        members = [i for i, g in enumerate(self.layer_groups) if g == group]
        if index[0] >= len(members):
            raise ValueError(f"{path!r}: layer {index[0]} of group {group!r} does not exist")
        return (members[index[0]], *index[1:])


def decoder_key_table(
    layer_rules: tuple[KeyRule | tuple, ...] = (), *, ignore_hf: tuple[str, ...] = ()
) -> KeyTable:
    """The key table of a decoder whose HF keys equal edl's but for the layer stacking,
    except ``layer_rules``: ``(hf, edl)`` templates relative to one layer (HF
    ``model.layers.{layer}.<hf>`` <-> edl ``model.layers.<edl>``), or ``KeyRule``s of such
    relative templates. Each rule also covers the bare trunk (HF ``...Model``: no
    ``model.`` prefix)."""
    rules: list[KeyRule] = []
    for prefix in ("model.", ""):
        for rule in (*layer_rules, ("{name}", "{name}")):
            r = rule if isinstance(rule, KeyRule) else KeyRule(*rule)
            edl = tuple(f"{prefix}layers.{e}" for e in r.edl_templates)
            rules.append(
                dataclasses.replace(
                    r, hf=f"{prefix}layers.{{layer}}.{r.hf}", edl=edl[0] if len(edl) == 1 else edl
                )
            )
    rules.append(KeyRule("{name}", "{name}"))
    return KeyTable(tuple(rules), ignore_hf=ignore_hf)
