"""Settings objects: frozen dataclasses whose fields are options, each field's name, help,
range and choices declared once, in its metadata.

One declaration serves every surface: the library (``edl.train.RunConfig(...)``), the
``edl train`` flags, the keys of its ``--config`` TOML file and the configuration recorded in
``run.md``. Settings nest (a field whose default is itself a settings object is a section);
each option also has a flat *name*, unique across the nesting, that is its flag
(``--save-every``), its TOML key and its key in ``to_options``. Nothing here imports jax:
``edl train --help`` and a wrong option answer before it loads.

Hand-written rather than a dependency (``simple-parsing``, ``draccus``): edl needs flags and
TOML keys that stay flat while the library objects nest, ranges and registry-backed choices
checked with messages naming the option, and no import of jax or of a heavy parser at
``--help``; the mechanism is ~200 lines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = [
    "ConfigError",
    "Leaf",
    "Option",
    "Registered",
    "check_option",
    "check_options",
    "from_options",
    "leaves",
    "option",
    "to_options",
]

S = TypeVar("S")


class ConfigError(ValueError):
    """An option's value is wrong; the message names the option (and the file)."""


@dataclasses.dataclass(frozen=True)
class Registered:
    """Choices that are the names of a registry, ``"module:NAME"`` (or of several,
    ``"module:NAME,module:NAME"``; plus ``extra`` ones): read when a value is checked,
    since the registry's module imports jax."""

    registry: str
    extra: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        """``extra`` and the registries' names, as registered now."""
        names = list(self.extra)
        for where in self.registry.split(","):
            module, _, name = where.partition(":")
            names += [n for n in getattr(importlib.import_module(module), name) if n not in names]
        return tuple(names)

    def __str__(self) -> str:
        places = [r.replace(":", ".") for r in self.registry.split(",")]
        where = "a name in " + " or ".join(places)
        extra = " / ".join(e if e else repr(e) for e in self.extra)  # '' (a default) visible
        return f"{extra} or {where}" if self.extra else where


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field's metadata says of its option.

    ``name``: the flat name (flag, TOML key), default the field's own name. ``parse`` turns
    the option's text form (a flag's argument, a TOML string) into the field's value, for
    fields that are not a plain ``int`` / ``float`` / ``str`` / ``bool``; ``text`` is its
    inverse (shown as the default in ``--help``).
    """

    help: str
    name: str | None = None
    low: int | float | None = None
    high: int | float | None = None
    choices: tuple[str, ...] | None = None
    registry: Registered | None = None
    parse: Callable[[str], object] | None = None
    text: Callable[[Any], str] | None = None


def option(default: object, help: str, **spec: Any) -> Any:
    """A dataclass field holding an option: its default and its ``Option`` (``help``, and
    ``name``, ``low``, ``high``, ``choices``, ``registry``, ``parse``, ``text``)."""
    meta = Option(help, **spec)
    if meta.registry is not None:
        meta = dataclasses.replace(meta, help=f"{help}: {meta.registry}")
    return dataclasses.field(default=default, metadata={"option": meta})


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One option of a (nested) settings class: where it sits (``path`` of attribute
    names from the root), its field, its ``Option`` and its resolved type."""

    path: tuple[str, ...]
    field: dataclasses.Field[Any]
    spec: Option
    hint: Any

    @property
    def name(self) -> str:
        """The flat name: flag (with ``-`` for ``_``), TOML key, ``to_options`` key."""
        return self.spec.name or self.field.name

    @property
    def scalar(self) -> type | None:
        """``int`` / ``float`` / ``str`` / ``bool`` when the value (or its non-``None`` form)
        is one of them, else ``None`` (a value with a ``parse``)."""
        arms = typing.get_args(self.hint) if _is_union(self.hint) else (self.hint,)
        return next((a for a in arms if a in (bool, int, float, str)), None)

    def shown(self, value: object) -> str:
        """``value`` as ``--help`` shows a default."""
        return self.spec.text(value) if self.spec.text is not None else str(value)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _sections(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


@functools.cache
def leaves(cls: type) -> dict[str, Leaf]:
    """Every option of settings class ``cls``, nested sections included, by flat name, in
    field order. Raises ``TypeError`` when two options share a flat name."""
    out: dict[str, Leaf] = {}
    for field, hint in _sections(cls):
        if "option" in field.metadata:
            leaf = Leaf((field.name,), field, field.metadata["option"], hint)
            found = {leaf.name: leaf}
        elif dataclasses.is_dataclass(hint):
            found = {
                n: dataclasses.replace(leaf, path=(field.name, *leaf.path))
                for n, leaf in leaves(hint).items()
            }
        else:
            continue  # a field that is not an option (a value only the library sets)
        clash = set(found) & set(out)
        if clash:
            raise TypeError(f"{cls.__name__}: option name {sorted(clash)[0]!r} is used twice")
        out.update(found)
    return out


def _own_leaves(settings: object) -> list[Leaf]:
    return [leaves(type(settings))[n] for n in _own_names(type(settings))]


@functools.cache
def _own_names(cls: type) -> tuple[str, ...]:
    return tuple(n for n, leaf in leaves(cls).items() if len(leaf.path) == 1)


def check_value(leaf: Leaf, value: object) -> None:
    """Raise ``ConfigError`` unless ``value`` suits ``leaf`` (type, range, choice)."""
    name, spec = leaf.name, leaf.spec
    if not _fits(value, leaf.hint):
        kind = leaf.scalar.__name__ if leaf.scalar is not None else str(leaf.hint)
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"{name} must be {article} {kind}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    choices = spec.choices
    if spec.registry is not None and value not in spec.registry.extra:
        choices = spec.registry.names()
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if numeric and spec.low is not None and value < spec.low:
        raise ConfigError(f"{name} must be >= {spec.low:g}, got {value!r}")
    if numeric and spec.high is not None and value > spec.high:
        raise ConfigError(f"{name} must be <= {spec.high:g}, got {value!r}")
    if choices is not None and value not in choices:
        shown = ", ".join(c if c else repr(c) for c in choices)  # '' (a default) visible
        raise ConfigError(f"{name} must be one of {shown}; got {value!r}")


def _fits(value: object, hint: Any) -> bool:
    """``value`` is of type ``hint`` (a bool is no int; an int is a float; tuples by item)."""
    if _is_union(hint):
        return any(_fits(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(_fits, value, args))
    return isinstance(value, typing.get_origin(hint) or hint)


def check_options(settings: object, *, registered: bool | None = None) -> None:
    """Check the options that are fields of ``settings`` itself (its sections check
    themselves when made). ``registered``: only the options whose choices a registry holds
    (``True``; reading one imports its module, so they go last), only the others
    (``False``), or all (``None``)."""
    for leaf in _own_leaves(settings):
        if registered is None or registered == (leaf.spec.registry is not None):
            check_value(leaf, getattr(settings, leaf.field.name))


def check_option(cls: type, name: str, value: object) -> None:
    """Raise ``ConfigError`` unless ``value`` (or its text form) suits option ``name`` of
    settings class ``cls``; an unknown ``name`` is refused with the list of options."""
    table = leaves(cls)
    if name not in table:
        raise ConfigError(f"unknown option {name!r}; options: {', '.join(sorted(table))}")
    check_value(table[name], _coerce(table[name], value))


def _coerce(leaf: Leaf, value: object) -> object:
    """A TOML / flag value in the field's form: text parsed, lists as tuples."""
    if isinstance(value, str) and leaf.spec.parse is not None:
        return leaf.spec.parse(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def from_options(
    cls: type[S], values: Mapping[str, object], *, base: S | None = None, where: str = ""
) -> S:
    """``cls`` built from flat option ``values`` (names as ``leaves(cls)``), each put in its
    section, over ``base`` (default: ``cls``'s defaults). Unknown names, and values that do
    not fit, raise ``ConfigError`` naming the option (prefixed with ``where``)."""
    table = leaves(cls)
    nested: dict[str, Any] = {}
    for name, value in values.items():
        try:
            check_option(cls, name, value)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None
        leaf = table[name]
        value = _coerce(leaf, value)
        node = nested
        for part in leaf.path[:-1]:
            node = node.setdefault(part, {})
        node[leaf.path[-1]] = value
    return _build(cls, nested, base)


def _build(cls: type[S], nested: Mapping[str, Any], base: S | None) -> S:
    changes = {}
    for field, hint in _sections(cls):
        if field.name not in nested:
            continue
        value = nested[field.name]
        if isinstance(value, dict):
            inner = getattr(base, field.name) if base is not None else None
            value = _build(hint, value, inner if inner is not None else field.default)
        changes[field.name] = value
    if base is None:
        return cls(**changes)
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def to_options(settings: object) -> dict[str, object]:
    """The flat options of ``settings`` (JSON- and TOML-ready: tuples as lists), by name;
    ``from_options(type(settings), to_options(settings)) == settings``."""
    out: dict[str, object] = {}
    for name, leaf in leaves(type(settings)).items():
        value: Any = settings
        for part in leaf.path:
            value = getattr(value, part)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
