"""The one train-step program: jitted, on a mesh or not, donating what it replaces only.

A train step replaces ``step``, ``params`` and ``opt_state``; it passes ``other`` (frozen
weights: a LoRA base, layers left out of ``trainable``) through. Donating the whole state
would delete ``other``'s arrays, which the model the state was made from still shares (the
``base`` given to ``apply_lora`` would raise "Array has been deleted" after training). So the
program takes the state split by ``edl.state.split_other``: ``updated`` (donated) and
``other`` (kept, and not returned: the state after the step holds the very arrays passed in,
so nothing is copied either).

:class:`StepProgram` is that program for any step function ``fn(state, batch, constants)``:
``constants`` (a frozen DPO reference model's arrays, ...) are an argument of the compiled
program, neither baked into it as constants nor donated, placed on the mesh by the step's
rules. It implements the :class:`Step` protocol the loop relies on: call it like the
function, ``place(state)`` (on its mesh; a no-op without one), and
``lower(state, batch).compile()`` ahead of time, whose result is called as
``compiled(state, batch)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from edl import state as edl_state
from edl.sharding import Rules, batch_spec, shard, state_shardings
from edl.state import StateLayout, TrainState

__all__ = ["CompiledStep", "LoweredStep", "Step", "StepProgram"]

StepFn = Callable[[TrainState, Any, Any], tuple[TrainState, Any]]
"""``fn(state, batch, constants) -> (state, metrics)``."""


@runtime_checkable
class Step(Protocol):
    """A train step the loop compiles ahead of time: ``step(state, batch) -> (state,
    metrics)``, ``place(state)`` (the state where the step's program wants it), and
    ``lower(state, batch).compile()`` (a :class:`CompiledStep`)."""

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]: ...

    def place(self, state: TrainState) -> TrainState: ...

    def lower(
        self, state: TrainState, batch: PyTree, *, platforms: Sequence[str] | None = None
    ) -> LoweredStep: ...


def _on_layout(fn: StepFn, layout: StateLayout) -> Callable:
    """``fn`` as ``(updated, other, batch, constants) -> (updated, metrics)`` for states of
    ``layout``."""

    def split_step(updated, other, batch, constants):
        new_state, metrics = fn(edl_state.join_other(layout, updated, other), batch, constants)
        new_layout, new_updated, new_other = edl_state.split_other(new_state)
        if new_layout != layout or any(a is not b for a, b in zip(new_other, other, strict=True)):
            # The caller's state keeps its own ``other``, so a changed one would be lost.
            raise ValueError(
                "train step: the step changed state.other (or the state's structure); only "
                "step, params and opt_state may change"
            )
        return new_updated, metrics

    return split_step


class LoweredStep:
    """A :class:`StepProgram` lowered for one state structure; ``compile()`` gives a
    :class:`CompiledStep`. Other attributes (``as_text``, ``cost_analysis``) are the
    lowered program's (``jax.stages.Lowered``)."""

    def __init__(self, lowered: Any, layout: StateLayout, constants: PyTree) -> None:
        self.lowered, self.layout, self.constants = lowered, layout, constants

    def compile(self) -> CompiledStep:
        return CompiledStep(self.lowered.compile(), self.layout, self.constants)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)


class CompiledStep:
    """A compiled :class:`StepProgram` called as ``compiled(state, batch) -> (state,
    metrics)``. Other attributes (``memory_analysis``, ``as_text``) are the compiled
    program's."""

    def __init__(self, compiled: Any, layout: StateLayout, constants: PyTree) -> None:
        self.compiled, self.layout, self.constants = compiled, layout, constants

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]:
        layout, updated, other = edl_state.split_other(state)
        if layout != self.layout:
            raise ValueError(
                "train step: compiled for a state of another structure; lower it again "
                f"for this one.\n  compiled for: {self.layout.treedef}\n  got: {layout.treedef}"
            )
        new_updated, metrics = self.compiled(updated, other, batch, self.constants)
        return edl_state.join_other(layout, new_updated, other), metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


class StepProgram:
    """``fn(state, batch, constants) -> (state, metrics)`` under ``jax.jit``, donating the
    input state's ``step``, ``params`` and ``opt_state`` (with ``donate``), never ``other``
    or ``constants``; a :class:`Step`.

    Args:
        fn: the step function.
        mesh: run SPMD on this mesh: in / out shardings derived from the first state and
            batch of each structure (the state by ``edl.sharding.state_shardings``, batch
            arrays split over ``dp`` / ``fsdp``, metrics replicated), traced under
            ``jax.set_mesh`` so the models' activation constraints apply. None: one device,
            inputs used where they are.
        rules: partition rules on the mesh (None: the state's model's own, replicated where
            it has none); ``constants`` are placed by the same rules.
        donate: donate the buffers the step replaces.
        constants: arrays every call passes to ``fn`` as they are (a pytree; ``()`` for
            none).

    One program per state structure (``edl.state.split_other``'s layout) and, on a mesh,
    batch structure.
    """

    def __init__(
        self,
        fn: StepFn,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        donate: bool = True,
        constants: PyTree = (),
    ) -> None:
        self.fn, self.mesh, self.rules, self.donate = fn, mesh, rules, donate
        self.constants = constants
        self._placed: PyTree | None = None
        self._jitted: dict[Any, Any] = {}

    def _rules(self, state: TrainState) -> Rules:
        """The step's rules; without any, the model's own, else none (all replicated)."""
        if self.rules is not None:
            return self.rules
        return state.partition_rules or ()

    def shardings(self, state: TrainState, batch: PyTree) -> tuple[Any, Any]:
        """``(state shardings, batch shardings)`` this step uses on its mesh."""
        if self.mesh is None:
            raise ValueError("StepProgram.shardings: the step has no mesh")
        mesh = self.mesh
        batch_shardings = jax.tree.map(
            lambda x: NamedSharding(mesh, batch_spec(x.shape, mesh)), batch
        )
        return state_shardings(state, self._rules(state), mesh), batch_shardings

    def _constants(self, state: TrainState) -> PyTree:
        """``constants``, placed on the mesh by the step's rules the first time."""
        if self.mesh is None:
            return self.constants
        if self._placed is None:
            self._placed = shard(self.constants, self._rules(state), self.mesh)
        return self._placed

    def _jit_kwargs(self, state: TrainState, batch: PyTree, constants: PyTree) -> dict:
        if self.mesh is None:
            return {}
        state_sh, batch_sh = self.shardings(state, batch)
        _, updated_sh, other_sh = edl_state.split_other(state_sh)
        constants_sh = jax.tree.map(lambda x: x.sharding, constants)
        return {
            "in_shardings": (updated_sh, other_sh, batch_sh, constants_sh),
            "out_shardings": (updated_sh, NamedSharding(self.mesh, PartitionSpec())),
        }

    def _jit(self, state: TrainState, batch: PyTree) -> tuple[StateLayout, Any, Any, Any, Any]:
        """``(layout, updated, other, constants, jitted)``: the state split, the constants
        placed, and the program for them."""
        layout, updated, other = edl_state.split_other(state)
        constants = self._constants(state)
        key = layout if self.mesh is None else (layout, jax.tree.structure(batch))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                _on_layout(self.fn, layout),
                donate_argnums=(0,) if self.donate else (),
                **self._jit_kwargs(state, batch, constants),
            )
        return layout, updated, other, constants, self._jitted[key]

    def place(self, state: TrainState) -> TrainState:
        """``state`` on this step's mesh (a no-op for arrays already placed there, and
        without a mesh)."""
        if self.mesh is None:
            return state
        return jax.device_put(state, state_shardings(state, self._rules(state), self.mesh))

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Any]:
        state = self.place(state)
        with _on_mesh(self.mesh):
            layout, updated, other, constants, jitted = self._jit(state, batch)
            new_updated, metrics = jitted(updated, other, batch, constants)
        return edl_state.join_other(layout, new_updated, other), metrics

    def lower(
        self, state: TrainState, batch: PyTree, *, platforms: Sequence[str] | None = None
    ) -> LoweredStep:
        """The step lowered for ``state`` and ``batch`` (``.compile()`` it; arrays or
        ``jax.ShapeDtypeStruct`` leaves; on a mesh, call the result on ``place(state)``).
        ``platforms``: lower for these platforms instead of the devices' (``"cpu"``,
        ``"cuda"``, ``"rocm"``, ``"tpu"``), e.g. ahead of time for a TPU fleet from a CPU
        host; kernels follow the platform (``edl.platforms``), and such a program compiles
        only where that platform's backend is."""
        with _on_mesh(self.mesh):
            layout, updated, other, constants, jitted = self._jit(state, batch)
            traced = jitted.trace(updated, other, batch, constants)
            lowering = {} if platforms is None else {"lowering_platforms": tuple(platforms)}
            return LoweredStep(traced.lower(**lowering), layout, constants)


def _on_mesh(mesh: Mesh | None) -> Any:
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
