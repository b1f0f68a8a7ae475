"""Registries of named variants (quantization formats, preference losses, GRPO losses): a
read-only mapping ``name -> entry`` that grows by :meth:`Registry.register`, so that adding a
variant is one entry, and every list of choices (an option's check, a CLI flag, a docs
line) reads the registry instead of a copy of its names.

    QUANT_FORMATS = Registry("quantization format", [QuantFormat("int8", ...), ...])
    QUANT_FORMATS.register(QuantFormat("int4", ...))         # one more variant, process-wide
    with QUANT_FORMATS.registered(QuantFormat("toy", ...)):  # scoped: gone again afterwards
        ...
    QUANT_FORMATS.lookup(name, "QuantConfig.format")         # the entry, or a ValueError

Imports nothing itself; the registries live in the modules that implement their variants
(``edl.ops.quant``, ``edl.train.preference``, ``edl.train.grpo_objective``,
``edl.train.optimizers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["Registry"]


@runtime_checkable
class Named(Protocol):
    """A registry entry: anything with a ``name``."""

    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Mapping[str, E]):
    """``name -> entry`` for the variants of one ``kind``, in registration order.

    Entries are values (typically frozen dataclasses with a ``name`` field); names are unique,
    and a registered name is never silently replaced. A name is also a key of compiled
    programs where it is a static argument (``QuantizedLinear.format``, a loss type baked
    into a train step): replacing an entry under a name already compiled in this process does
    not retrace those programs, so register new variants under new names.
    """

    def __init__(self, kind: str, entries: Iterable[E] = ()) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}
        for entry in entries:
            self.register(entry)

    def __getitem__(self, name: str) -> E:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"

    def lookup(self, name: object, who: str) -> E:
        """The entry called ``name``; else ``ValueError("<who> must be one of <names>, got
        <name>")``."""
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ValueError(f"{who} must be one of {', '.join(self._entries)}, got {name!r}")
        return entry

    def register(self, entry: E) -> E:
        """Add ``entry`` under ``entry.name`` and return it. Raises ``ValueError`` for a name
        that is not a non-empty string without spaces or commas (it is a command-line choice),
        or that is taken (:meth:`unregister` it first)."""
        name = entry.name
        if not isinstance(name, str) or not name or any(c.isspace() or c == "," for c in name):
            raise ValueError(
                f"{self.kind} names must be non-empty strings without spaces or "
                f"commas, got {name!r}"
            )
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered "
                f"({self._entries[name]!r}); unregister it first"
            )
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> E:
        """Remove the entry called ``name`` and return it (``ValueError`` if there is none)."""
        entry = self.lookup(name, f"unregister: the {self.kind}")
        del self._entries[name]
        return entry

    @contextlib.contextmanager
    def registered(self, *entries: E) -> Iterator[tuple[E, ...]]:
        """Register ``entries`` for the ``with`` block only (tests: nothing leaks into later
        ones); they are unregistered on the way out, also after an error."""
        done: list[E] = []
        try:
            for entry in entries:
                done.append(self.register(entry))
            yield tuple(done)
        finally:
            for entry in reversed(done):
                del self._entries[entry.name]
