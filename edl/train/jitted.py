"""Jitted train steps that donate what they replace and nothing else.

A train step replaces ``step``, ``params`` and ``opt_state``; it passes ``other`` (frozen
weights: a LoRA base, layers left out of ``trainable``) through. Donating the whole state
would delete ``other``'s arrays, which the model the state was made from still shares (the
``base`` given to ``apply_lora`` would raise "Array has been deleted" after training). So the
program takes the state split by ``edl.state.split_other``: ``updated`` (donated) and
``other`` (kept, and not returned: the state after the step holds the very arrays passed in,
so nothing is copied either).

:class:`JittedStep` (``jax.jit``) and :class:`ShardedStep` (``jax.jit`` on a mesh, with
shardings derived from the state) keep the function's interface: ``step(state, batch)``, and
``step.lower(state, batch).compile()`` whose result is called as ``compiled(state, batch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from edl import state as edl_state
from edl.sharding import Rules, batch_spec, state_shardings
from edl.state import StateLayout, TrainState

__all__ = ["JittedStep", "ShardedStep"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, Any]]


def _on_layout(fn: StepFn, layout: StateLayout) -> Callable:
    """``fn`` as ``(updated, other, batch) -> (updated, metrics)`` for states of ``layout``."""

    def split_step(updated, other, batch):
        new_state, metrics = fn(edl_state.join_other(layout, updated, other), batch)
        new_layout, new_updated, new_other = edl_state.split_other(new_state)
        if new_layout != layout or any(a is not b for a, b in zip(new_other, other, strict=True)):
            # The caller's state keeps its own ``other``, so a changed one would be lost.
            raise ValueError(
                "train step: the step changed state.other (or the state's structure); only "
                "step, params and opt_state may change"
            )
        return new_updated, metrics

    return split_step


class _Lowered:
    """``jax.stages.Lowered`` of a split step; ``compile()`` gives a ``(state, batch)``
    callable. Other attributes (``as_text``, ``cost_analysis``) are the lowered program's."""

    def __init__(self, lowered: Any, layout: StateLayout) -> None:
        self.lowered, self.layout = lowered, layout

    def compile(self) -> _Compiled:
        return _Compiled(self.lowered.compile(), self.layout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)


class _Compiled:
    """A compiled split step called as ``compiled(state, batch) -> (state, metrics)``.
    Other attributes (``memory_analysis``, ``as_text``) are the compiled program's."""

    def __init__(self, compiled: Any, layout: StateLayout) -> None:
        self.compiled, self.layout = compiled, layout

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]:
        layout, updated, other = edl_state.split_other(state)
        if layout != self.layout:
            raise ValueError(
                "train step: compiled for a state of another structure; lower it again "
                f"for this one.\n  compiled for: {self.layout.treedef}\n  got: {layout.treedef}"
            )
        new_updated, metrics = self.compiled(updated, other, batch)
        return edl_state.join_other(layout, new_updated, other), metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


class JittedStep:
    """``fn(state, batch) -> (state, metrics)`` under ``jax.jit``, donating the input
    state's ``step``, ``params`` and ``opt_state`` (with ``donate``) but never ``other``.

    One jitted program per state structure (``edl.state.split_other``'s layout). Call it like
    the function, or ``lower(state, batch).compile()`` ahead of time and call the result.
    """

    def __init__(self, fn: StepFn, *, donate: bool = True) -> None:
        self.fn, self.donate = fn, donate
        self._jitted: dict[Any, Any] = {}

    def _jit_kwargs(self, state: TrainState, batch: PyTree) -> dict[str, Any]:
        """Extra ``jax.jit`` arguments for this state and batch (shardings, on a mesh)."""
        return {}

    def _cache_key(self, layout: StateLayout, batch: PyTree) -> Any:
        return layout

    def _jit(self, state: TrainState, batch: PyTree) -> tuple[StateLayout, Any, Any, Any]:
        """``(layout, updated, other, jitted)``: the state split, and the program for it."""
        layout, updated, other = edl_state.split_other(state)
        key = self._cache_key(layout, batch)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                _on_layout(self.fn, layout),
                donate_argnums=(0,) if self.donate else (),
                **self._jit_kwargs(state, batch),
            )
        return layout, updated, other, self._jitted[key]

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]:
        layout, updated, other, jitted = self._jit(state, batch)
        new_updated, metrics = jitted(updated, other, batch)
        return edl_state.join_other(layout, new_updated, other), metrics

    def lower(
        self, state: TrainState, batch: PyTree, *, platforms: Sequence[str] | None = None
    ) -> _Lowered:
        """The step lowered for ``state`` and ``batch`` (``.compile()`` it; arrays or
        ``jax.ShapeDtypeStruct`` leaves). ``platforms``: lower for these platforms instead
        of the devices' (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), e.g. ahead of time for
        a TPU fleet from a CPU host; kernels follow the platform (``edl.platforms``), and such
        a program compiles only where that platform's backend is."""
        layout, updated, other, jitted = self._jit(state, batch)
        traced = jitted.trace(updated, other, batch)
        lowering = {} if platforms is None else {"lowering_platforms": tuple(platforms)}
        return _Lowered(traced.lower(**lowering), layout)


class ShardedStep(JittedStep):
    """A :class:`JittedStep` for a mesh, with in/out shardings derived from the first state
    and batch it sees (one compiled program per state/batch structure). Call it like the
    function (it places the state first), or ``lower(state, batch).compile()`` ahead of time
    and call the result on ``place(state)`` (``edl.train.train`` does)."""

    def __init__(self, fn: StepFn, mesh: Mesh, rules: Rules | None, *, donate: bool = True) -> None:
        super().__init__(fn, donate=donate)
        self.mesh, self.rules = mesh, rules

    def _rules(self, state: TrainState) -> Rules:
        """The step's rules; without any, the model's own, else none (all replicated)."""
        if self.rules is not None:
            return self.rules
        return state.partition_rules or ()

    def shardings(self, state: TrainState, batch: PyTree) -> tuple[Any, Any]:
        """``(state shardings, batch shardings)`` this step uses."""
        batch_shardings = jax.tree.map(
            lambda x: NamedSharding(self.mesh, batch_spec(x.shape, self.mesh)), batch
        )
        return state_shardings(state, self._rules(state), self.mesh), batch_shardings

    def _cache_key(self, layout: StateLayout, batch: PyTree) -> Any:
        return layout, jax.tree.structure(batch)

    def _jit_kwargs(self, state: TrainState, batch: PyTree) -> dict[str, Any]:
        state_sh, batch_sh = self.shardings(state, batch)
        _, updated_sh, other_sh = edl_state.split_other(state_sh)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return {
            "in_shardings": (updated_sh, other_sh, batch_sh),
            "out_shardings": (updated_sh, replicated),
        }

    def place(self, state: TrainState) -> TrainState:
        """``state`` on this step's mesh (a no-op for arrays already placed there)."""
        return jax.device_put(state, state_shardings(state, self._rules(state), self.mesh))

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]:
        state = self.place(state)
        with jax.set_mesh(self.mesh):
            return super().__call__(state, batch)

    def lower(
        self, state: TrainState, batch: PyTree, *, platforms: Sequence[str] | None = None
    ) -> _Lowered:
        """As :meth:`JittedStep.lower`, on this step's mesh."""
        with jax.set_mesh(self.mesh):
            return super().lower(state, batch, platforms=platforms)
