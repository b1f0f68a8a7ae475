"""Choosing code by the platform a program is lowered for.

JAX traces a program once and lowers it later, for a platform that tracing does not know:
``jax.jit(f)(x)`` lowers for the device ``x`` lives on, ``jax.jit(f).trace(...).lower(
lowering_platforms=("tpu",))`` compiles ahead of time for a TPU fleet from a CPU host, and
``jax.export`` may lower one program for several platforms at once. So edl never asks the
process for its default backend to pick a kernel: each choice is one
``jax.lax.platform_dependent`` over :data:`PLATFORMS`, whose branches are all traced and of
which lowering keeps only the one for the platform lowered for (a program exported for
several platforms keeps one per platform and picks when it is compiled).

:func:`platform_dependent` is jax's, with one addition: each branch is traced knowing the
platforms it is for, and a choice nested inside it builds branches for those platforms only
(inside the CPU branch of remat ``"auto"``, attention traces the CPU kernel and not the
Triton and Mosaic ones, which that branch can never run). Tracing every kernel of every
platform costs a train step's first trace ~0.7 s on CPU otherwise.

What can only be decided once the platform is known is decided when a branch is lowered, by
identities on an array that act then (run eagerly, with nothing to lower, they act at once,
for the process's own platform):

- :func:`notice_when_lowered` warns, once per message, when its branch is lowered (a kernel
  that cannot take these inputs on that platform, and the fallback that runs instead);
- :func:`fail_when_lowered` raises ``ValueError`` when its branch is lowered (a kernel asked
  for by name that cannot run on that platform); :func:`failing` makes such a branch;
- :func:`host_check` applies a check that calls back to the host (``jax.pure_callback``) only
  where the program can hold one: jax builds a host callback against the backend of the
  platform it lowers for, which a program lowered for ``"tpu"`` on a CPU-only host, or for
  several platforms at once, does not have. Elsewhere the value passes unchecked.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, get_opaque_trace_state, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

__all__ = [
    "PLATFORMS",
    "can_run_here",
    "carry_platforms",
    "fail_when_lowered",
    "failing",
    "host_check",
    "notice_when_lowered",
    "platform_dependent",
]

# The platforms edl chooses kernels for (jax's lowering-platform names); any other platform
# gets a choice's ``default`` branch.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_OTHER = "*"  # any platform not in PLATFORMS: a choice's default branch
_noticed: set[str] = set()  # warnings already given (once per message and process)

# The platforms the code being traced can run on, and the trace they hold for: set while a
# branch of ``platform_dependent`` is traced. A choice made in another trace (jax traces a
# jitted function, a scan body or a checkpointed function in a trace of its own) sees no
# restriction: jax caches the traces of long-lived functions by the function alone, and one
# traced for the CPU branch would be reused where every platform's branches are needed. edl
# carries the restriction into the traces of closures it makes afresh (``carry_platforms``).
# Functions jax calls later (a custom_vjp's rules, at differentiation) see none either.
_within: contextvars.ContextVar[tuple[frozenset[str], Any] | None] = contextvars.ContextVar(
    "edl_platforms_within", default=None
)


def _in_context(fn: Callable[..., Any], platforms: frozenset[str]) -> Callable[..., Any]:
    def traced(*args):
        token = _within.set((platforms, get_opaque_trace_state()))
        try:
            return fn(*args)
        finally:
            _within.reset(token)

    return traced


def _restriction() -> frozenset[str] | None:
    """The platforms the code being traced runs on, or None (any)."""
    within = _within.get()
    if within is None or within[1] != get_opaque_trace_state():
        return None
    return within[0]


def _among(platform: str, platforms: frozenset[str]) -> bool:
    return platform in platforms or (platform not in PLATFORMS and _OTHER in platforms)


def can_run_here(platform: str) -> bool:
    """Whether the code being traced can run on ``platform``: False inside a branch of
    :func:`platform_dependent` for other platforms (a choice there needs no branch for it)."""
    platforms = _restriction()
    return platforms is None or _among(platform, platforms)


def carry_platforms(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for jax to trace in a trace of its own (a scan body, a checkpointed or
    ``shard_map``ped function), keeping what :func:`can_run_here` says where it is made.
    Only for a closure made afresh each time its maker is traced: jax caches the traces of
    long-lived functions, and may reuse one where other platforms' branches are needed."""
    platforms = _restriction()
    return fn if platforms is None else _in_context(fn, platforms)


def platform_dependent(
    *args: Any, default: Callable[..., Any], **per_platform: Callable[..., Any]
) -> Any:
    """``jax.lax.platform_dependent(*args, default=default, **per_platform)`` (platforms by
    jax's lowering names, ``default`` for the rest), each branch traced knowing the platforms
    it runs on: inside a branch, a nested choice keeps only the branches of those platforms
    (the others can never run there, and are not traced)."""
    unknown = set(per_platform) - set(PLATFORMS)
    if unknown:
        raise ValueError(f"platform_dependent: unknown platforms {sorted(unknown)}; {PLATFORMS}")
    live = set(filter(can_run_here, (*PLATFORMS, _OTHER)))
    sharing: dict[int, list[str]] = {}  # one traced branch per function, for all its platforms
    for p, fn in per_platform.items():
        if p in live:
            sharing.setdefault(id(fn), []).append(p)
    wrapped = {key: _in_context(per_platform[ps[0]], frozenset(ps)) for key, ps in sharing.items()}
    branches = {p: wrapped[key] for key, ps in sharing.items() for p in ps}
    rest = frozenset(live - set(per_platform))  # what the default branch runs on
    if rest and not branches:
        return _in_context(default, rest)(*args)  # only the default can run here
    if not rest and len(wrapped) == 1:
        return next(iter(wrapped.values()))(*args)  # only this branch can run here
    # With every live platform named, the default never runs: any branch stands in for it.
    fallback = _in_context(default, rest) if rest else next(iter(branches.values()))
    return jax.lax.platform_dependent(*args, default=fallback, **branches)


# -- notices: warn or fail when a branch is lowered --------------------------------------------


def _act(message: str, error: bool, platform: str) -> None:
    text = message.replace("{platform}", platform)  # not format(): reasons may hold braces
    if error:
        raise ValueError(text)
    if text not in _noticed:
        _noticed.add(text)
        warnings.warn(text, stacklevel=4)


def _notice_impl(x, *, message: str, error: bool, platforms: frozenset[str] | None):
    # Eager: the branch runs where x lives (jax names a GPU device's platform "gpu").
    _act(message, error, "/".join(sorted(platforms or {d.platform for d in x.devices()})))
    return x


def _notice_lowering(ctx, x, *, message: str, error: bool, platforms: frozenset[str] | None):
    # Lowered for several platforms at once (jax.export), every branch is lowered for all of
    # them: act only for those the branch holding the notice runs on.
    lowered = ctx.platforms or ctx.module_context.platforms
    relevant = [p for p in lowered if platforms is None or _among(p, platforms)]
    if relevant:
        _act(message, error, "/".join(relevant))
    return [x]


_notice_p = Primitive("edl_lowering_notice")
_notice_p.def_impl(_notice_impl)
_notice_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(_notice_p, _notice_lowering)
# Tangents and batches pass straight through: the notice is about the branch, once is enough.
ad.primitive_jvps[_notice_p] = lambda primals, tangents, **params: (
    _notice_p.bind(*primals, **params),
    tangents[0],
)
batching.primitive_batchers[_notice_p] = lambda args, dims, **params: (
    _notice_p.bind(*args, **params),
    dims[0],
)


def notice_when_lowered(x: Array, message: str) -> Array:
    """``x``, warning ``message`` (once per process) when the branch holding it is lowered.
    ``{platform}`` in ``message`` becomes the platform lowered for."""
    return _notice_p.bind(x, message=message, error=False, platforms=_restriction())


def fail_when_lowered(x: Array, message: str) -> Array:
    """``x``, raising ``ValueError(message)`` when the branch holding it is lowered.
    ``{platform}`` in ``message`` becomes the platform lowered for."""
    return _notice_p.bind(x, message=message, error=True, platforms=_restriction())


def failing_when_lowered_on_error(
    fn: Callable[..., Array], like: Callable[..., Array], message: Callable[[ValueError], str]
) -> Callable[..., Array]:
    """``fn`` as a ``platform_dependent`` branch whose ``ValueError`` while traced (a limit of
    that platform's kernel) is raised, as ``message(error)``, only when the branch is lowered:
    every branch is traced on every platform, and raising at once would stop programs that
    never run it. ``like(*args)`` gives the failing branch its output's shape."""

    def branch(*args):
        try:
            return fn(*args)
        except ValueError as error:
            out = jax.eval_shape(like, *args)
            return fail_when_lowered(jnp.zeros(out.shape, out.dtype), message(error))

    return branch


def failing(message: str, like: Callable[..., Array]) -> Callable[..., Array]:
    """A ``platform_dependent`` branch that fails with ``message`` when lowered; ``like(*args)``
    gives it an output of the right shape (traced, never computed)."""

    def branch(*args):
        return fail_when_lowered(like(*args), message)

    return branch


# -- host checks: callbacks only where the program can hold them -------------------------------


def _callbacks_lower(ctx) -> bool:
    """Whether a host callback lowers here: one platform, this process's backend for it."""
    return ctx.module_context.get_backend(optional=True) is not None


def _host_check_lowering(ctx, x, *operands, check: ClosedJaxpr):
    if not _callbacks_lower(ctx):
        return [x]
    return mlir.lower_fun(jaxpr_as_fun(check), multiple_results=True)(ctx, x, *operands)


def _host_check_batch(args, dims, *, check: ClosedJaxpr):
    # The check of a batch is the check vmapped (its callbacks see batched values).
    batched = jax.vmap(jaxpr_as_fun(check), in_axes=tuple(dims))
    closed = jax.make_jaxpr(batched)(*args)
    return _host_check_p.bind(*args, check=closed), [0]


_host_check_p = Primitive("edl_host_check")
_host_check_p.multiple_results = True
_host_check_p.def_impl(lambda *args, check: jaxpr_as_fun(check)(*args))
_host_check_p.def_abstract_eval(lambda x, *_, check: [x])
mlir.register_lowering(_host_check_p, _host_check_lowering)
ad.primitive_jvps[_host_check_p] = lambda primals, tangents, **params: (
    _host_check_p.bind(*primals, **params),
    [tangents[0]],
)
batching.primitive_batchers[_host_check_p] = _host_check_batch


def host_check(x: Array, *operands: Array, check: Callable[..., Array]) -> Array:
    """``check(x, *operands)``, a function returning ``x`` tied to a check that may call back
    to the host (raising from there), where the program can hold a host callback (one
    lowering platform whose backend this process has); ``x`` unchanged elsewhere. Derivatives
    pass through ``x`` as an identity; ``operands`` are not differentiated.

    ``check`` is traced here, where it is called (a mesh set with ``jax.set_mesh`` applies),
    and lowered later only where callbacks lower."""
    closed = jax.make_jaxpr(check)(x, *operands)
    return _host_check_p.bind(x, *operands, check=closed)[0]
