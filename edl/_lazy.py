"""Lazy package attributes (PEP 562), so that ``import edl`` (and ``edl --help``) load no jax
until a name that needs it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to
    ``"module"`` (the name is that submodule) or ``"module:attribute"``; the module is
    imported on first access and the value cached in the package's namespace."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
