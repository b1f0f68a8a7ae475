"""Kernel tables: which kernel an op runs, per platform the program is lowered for.

An op with kernels (``attention``, ``cached_attention``, ``paged_attention``) keeps a table
``platform -> kernels``, in the order ``impl="auto"`` prefers them, and a plain-XLA fallback.
:func:`by_platform` turns the table into one ``jax.lax.platform_dependent`` (see
``edl.platforms``): for each platform it takes the first kernel of the table that can take
the call's arrays (``Kernel.unsupported``), and

- with ``impl="auto"``, the fallback where none can, warning when that branch is lowered that
  (and why) the kernels it prefers do not run there (no warning for a kernel the user turned
  off, ``Kernel.quiet``);
- with an impl named (``"pallas"``, ``"native"``), that impl's kernel; a platform where it
  cannot run fails when lowered for it, and an impl no platform can run fails at once.

Every branch is traced, so a table's kernels must trace anywhere: a check that only holds on
one platform (GPU tile limits) belongs in ``unsupported``. A ``ValueError`` a kernel raises
while tracing all the same makes its branch fall back (``"auto"``) or fail when lowered for
that platform, never the trace (which would stop programs for every other platform).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from edl.platforms import (
    PLATFORMS,
    can_run_here,
    failing,
    failing_when_lowered_on_error,
    notice_when_lowered,
    platform_dependent,
)

__all__ = ["Kernel", "by_platform", "never"]


def never(*_) -> bool:
    """A ``Kernel.preferred`` or ``quiet`` that always says no."""
    return False


def _always(*_) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One entry of a kernel table.

    Attributes:
        impl: the ``impl`` name that asks for it (``"pallas"``, ``"native"``).
        call: ``call(options, *arrays) -> output``; ``options`` is the op's static settings.
        unsupported: ``unsupported(options, *arrays)``: why it cannot take these arrays on
            its platform (a sentence), or None when it can. Called while tracing.
        preferred: ``preferred(options, *arrays)``: whether ``"auto"`` picks it for these
            arrays when it can take them (a kernel slower than XLA on some inputs); skipping
            it for that says nothing. A kernel named by ``impl`` runs whatever this says.
        quiet: skipping it because it cannot run says nothing (the user turned it off).
    """

    impl: str
    call: Callable[..., Array]
    unsupported: Callable[..., str | None]
    preferred: Callable[..., bool] = _always
    quiet: Callable[[], bool] = never


def _branch(
    op: str,
    impl: str,
    kernels: Sequence[Kernel],
    options: Any,
    arrays: tuple[Any, ...],
    fallback: Callable[..., Array],
) -> tuple[Callable[..., Array] | None, list[str]]:
    """This platform's branch (None when ``impl`` cannot run there) and why the preferred
    kernels do not run."""
    reasons: list[str] = []
    for kernel in kernels:
        if impl != kernel.impl and (impl != "auto" or not kernel.preferred(options, *arrays)):
            continue
        reason = kernel.unsupported(options, *arrays)
        if reason is None:
            call = _guarded(op, impl, kernel, options, fallback)
            return _noticed(op, reasons, kernel.impl, call), []
        if not kernel.quiet():
            reasons.append(reason)
    if impl == "auto":
        return _noticed(op, reasons, "xla", fallback), []
    return None, reasons


def _guarded(
    op: str, impl: str, kernel: Kernel, options: Any, fallback: Callable[..., Array]
) -> Callable[..., Array]:
    """``kernel.call`` as a branch. A ``ValueError`` it raises while tracing is a limit its
    ``unsupported`` did not name: the branch falls back (``"auto"``) or fails (an impl named)
    when lowered for this kernel's platform, never at once for every platform."""
    call = functools.partial(kernel.call, options)
    if impl != "auto":
        message = lambda error: f"{op}: impl={impl!r} cannot run on {{platform}}: {error}"
        return failing_when_lowered_on_error(call, like=fallback, message=message)

    def branch(*arrays):
        try:
            return call(*arrays)
        except ValueError as error:
            return notice_when_lowered(fallback(*arrays), f"edl {op}: {error}; using impl='xla'")

    return branch


def _noticed(
    op: str, reasons: list[str], using: str, fn: Callable[..., Array]
) -> Callable[..., Array]:
    """``fn``, warning (when lowered) why the kernels preferred to it were skipped."""
    if not reasons:
        return fn
    message = f"edl {op}: {'; '.join(reasons)}; using impl={using!r}"

    def branch(*arrays):
        return notice_when_lowered(fn(*arrays), message)

    return branch


def by_platform(
    op: str,
    impl: str,
    table: Mapping[str, Sequence[Kernel]],
    options: Any,
    arrays: tuple[Any, ...],
    *,
    fallback: Callable[..., Array],
) -> Array:
    """``op`` computed by the kernel ``impl`` names (or ``"auto"`` prefers) on each platform of
    ``table``, as one ``platform_dependent`` over ``arrays`` (module docstring); ``fallback``
    takes ``arrays`` too."""
    branches: dict[str, Callable[..., Array]] = {}
    failures: dict[str, list[str]] = {}
    built: dict[tuple, tuple] = {}  # platforms with one table share a branch
    for platform in filter(can_run_here, PLATFORMS):  # a nested choice needs fewer
        kernels = table.get(platform, ())
        key = tuple(map(id, kernels))
        if key not in built:
            built[key] = _branch(op, impl, kernels, options, arrays, fallback)
        branch, reasons = built[key]
        if branch is None:
            failures[platform] = reasons
        else:
            branches[platform] = branch
    if impl == "auto":
        return platform_dependent(*arrays, **branches, default=fallback)
    homes = [p for p, kernels in table.items() if any(k.impl == impl for k in kernels)]
    elsewhere = f"edl's {impl!r} kernel is for programs lowered for {'/'.join(homes)}"
    if not branches and all(map(can_run_here, PLATFORMS)):  # it runs nowhere: say so now
        reasons = sorted({r for rs in failures.values() for r in rs}) or [elsewhere]
        raise ValueError(f"{op}: impl={impl!r} cannot run: {'; '.join(reasons)}")
    out = jax.eval_shape(fallback, *arrays)

    def failed(reasons: list[str]) -> Callable[..., Array]:
        message = f"{op}: impl={impl!r} cannot run on {{platform}}: {'; '.join(reasons)}"
        return failing(message, lambda *_: jnp.zeros(out.shape, out.dtype))

    for platform, reasons in failures.items():
        branches[platform] = failed(reasons or [elsewhere])
    return platform_dependent(*arrays, **branches, default=failed([elsewhere]))
