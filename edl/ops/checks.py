"""Run-time checks of integer inputs (token ids, labels) that name the bad value.

``check_ids(ids, upper, name="input_ids")`` returns ``ids`` unchanged when every entry lies
in ``[0, upper)`` (entries equal to ``ignore`` aside) and otherwise raises, naming the
array, the allowed range and the offending value, e.g. ``input_ids must lie in [0, 64)
(vocab_size 64), got -1``. On concrete arrays it is a plain check that raises
``ValueError``; inside a traced program (``jax.jit``, ``lax.scan``, ``grad``, a KV-cache
decode loop, a mesh) the program computes the minimum and maximum and, only when one is out
of range, calls back to Python, which raises the same ``ValueError`` (under ``jax.jit`` it
reaches the caller as ``jax.errors.JaxRuntimeError`` with that message, or as the
``ValueError`` itself). Use the returned array: the check is tied to it, and would be
dropped as dead code otherwise.

Why edl's own rather than ``equinox.error_if``:

- ``error_if``'s message is fixed when the program is traced; this one names the value.
- ``error_if``'s callback runs on device 0 only (a callback in a partitioned program gets a
  single-device sharding). In a program split over several devices, device 0 stops with
  the error while the others run on into the next collective and wait for it forever (on
  the 8 host CPU devices XLA aborts the process after 40 s). Here, under a mesh
  (``jax.set_mesh``, as edl's train steps trace), the callback runs on every device inside a
  ``shard_map`` with the same all-reduced minimum and maximum, so every device stops at
  the same point. ``jax.debug.callback(partitioned=True)`` would also run on every device,
  but it is an effect, and a jitted function with effects leaves jax's C++ dispatch path,
  a cost on every call on top of any host callback's (``benchmarks/RESULTS.md``,
  "input_checks: what an effect costs per call").

Cost: a min and a max over the ids, and a price per compiled call for holding a host
callback, whatever the model's size. On CPU such a program runs synchronously (the call
returns when the computation is done), so the host cannot queue the next call meanwhile;
on GPU the conditional reads its predicate back to the host. ``benchmarks/RESULTS.md``,
"input_checks: token ids / labels in range, checked inside compiled programs", measures it:
a fixed price per call, so noticeable on a toy model's step (more when steps are queued back
to back), within the noise on ``edl train``'s default model. ``generate`` checks its prompt
eagerly and decodes without it; ``RunOptions(check_inputs=False)`` turns the models' check
off.

A program lowered where it cannot call back to this process (ahead of time for an
accelerator this host has no backend for, e.g. ``lowering_platforms=("tpu",)`` on a CPU host,
or for several platforms in one ``jax.export``) holds no check: the ids pass unchecked there
(``edl.platforms.host_check``), since jax can only build a host callback against the backend
it lowers for. Run on the device itself, the same program checks.

A program split over several devices without a mesh set (jit inferring the split from the
inputs' shardings) cannot be told apart from a one-device program while tracing; there the
callback runs on device 0 only, with the hazard above. Trace sharded programs under
``jax.set_mesh``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int

from edl.platforms import host_check

__all__ = ["check_ids", "error_if"]


def _out_of_range(
    low: ArrayLike, high: ArrayLike, upper: int, name: str, what: str, ignore: int | None
) -> str | None:
    """The error message for ``[low, high]`` (entries of ``ignore`` left out), or ``None``
    when every value lies in ``[0, upper)``. ``low`` / ``high`` may be batched (vmap)."""
    low, high = np.asarray(low), np.asarray(high)
    bad = sorted({int(v) for v in (*low.ravel(), *high.ravel()) if not 0 <= v < upper})
    if not bad:
        return None
    allowed = f"lie in [0, {upper}) ({what} {upper})"
    if ignore is not None:
        allowed = f"be {ignore} (ignored) or {allowed}"
    got = " and ".join(map(str, [bad[0], bad[-1]] if len(bad) > 1 else bad))
    return f"{name} must {allowed}, got {got}"


def check_ids(
    ids: Int[Array, "*shape"] | np.ndarray,
    upper: int,
    *,
    name: str = "input_ids",
    what: str = "vocab_size",
    ignore: int | None = None,
) -> Int[Array, "*shape"] | np.ndarray:
    """``ids`` unchanged after checking that each entry is in ``[0, upper)`` or equals
    ``ignore``; otherwise ``ValueError`` naming ``name``, the bound (``what`` says what it
    is) and the smallest and largest bad values. Works eagerly and traced (see the module
    docstring); the traced check is tied to the returned array, so use it."""
    if ids.size == 0:
        return ids
    if not isinstance(ids, jax.core.Tracer):
        values = np.asarray(ids)
        if ignore is not None:
            values = values[values != ignore]
        if values.size:
            message = _out_of_range(values.min(), values.max(), upper, name, what, ignore)
            if message is not None:
                raise ValueError(message)
        return ids
    checked = functools.partial(_traced_check, upper=upper, name=name, what=what, ignore=ignore)
    # A host callback lowers only where the program's platform has a backend in this
    # process (edl.platforms.host_check); elsewhere (lowered ahead of time for an accelerator
    # this host lacks, or for several platforms at once) the ids pass unchecked.
    return host_check(ids, check=checked)


def _traced_check(
    ids: Int[Array, "*shape"], *, upper: int, name: str, what: str, ignore: int | None
) -> Int[Array, "*shape"]:
    """``check_ids`` inside a traced program: ``ids`` tied to a conditional host callback that
    raises when the minimum or maximum is out of range."""
    kept = ids if ignore is None else jnp.where(ids == ignore, 0, ids)
    low, high = jnp.min(kept), jnp.max(kept)

    def report(low: ArrayLike, high: ArrayLike) -> np.ndarray:
        # Under vmap both branches of the cond run: raise only on real bad values.
        message = _out_of_range(low, high, upper, name, what, ignore)
        if message is not None:
            raise ValueError(message)
        return np.zeros(np.shape(low), np.asarray(low).dtype)

    def fail(low: jax.Array, high: jax.Array) -> jax.Array:
        def call(low, high):
            return jax.pure_callback(
                report,
                jax.ShapeDtypeStruct(low.shape, low.dtype),
                low,
                high,
                vmap_method="broadcast_all",
            )

        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return call(low, high)
        # On every device (see the module docstring), not on device 0 alone.
        return jax.shard_map(call, in_specs=(P(), P()), out_specs=P(), check_vma=False)(low, high)

    bad = (low < 0) | (high >= upper)
    zero = jax.lax.cond(bad, fail, lambda low, high: jnp.zeros_like(low), low, high)
    return ids + zero.astype(ids.dtype)


def error_if(x: Array, pred: Bool[Array, "*shape"], message: str) -> Array:
    """``equinox.error_if(x, pred, message)`` (``x``, raising ``message`` where ``pred`` holds)
    in programs that can call back to this process; elsewhere (lowered ahead of time for an
    accelerator this host has no backend for, or for several platforms at once) ``x``
    unchecked (``edl.platforms.host_check``)."""
    return host_check(x, pred, check=lambda x, pred: eqx.error_if(x, pred, message))
