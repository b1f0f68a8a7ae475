"""TrainState: a frozen pytree ``(step, params, other, opt_state)`` and pure functions on it.

EasyDeL's ``EasyDeLState`` without the object: every function returns a new state, so the
whole update is one traceable function::

    state = edl.state.create(model, optax.adamw(3e-4))

    @jax.jit(donate_argnums=0)          # or eqx.filter_jit(donate="all")
    def train_step(state, batch):
        loss, grads = edl.state.value_and_grad(loss_fn)(state, batch)
        return edl.state.apply_gradients(state, grads, tx), loss

Gradients are only ever taken with respect to ``params``; ``other`` (frozen weights, buffers,
static callables) gets neither gradients nor optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PyTree

from edl import module as edl_module
from edl import tree as edl_tree

__all__ = [
    "TrainState",
    "apply_gradients",
    "create",
    "init_tx",
    "model",
    "replace",
    "size",
    "value_and_grad",
]


class _Static:
    """The non-array part of a pytree, hashable so it can be pytree aux data (static under jit)."""

    __slots__ = ("_key", "tree")

    def __init__(self, tree: PyTree, field: str) -> None:
        leaves, treedef = jax.tree.flatten(tree)
        self.tree = tree
        self._key = (treedef, tuple(leaves))
        try:
            hash(self._key)
        except TypeError:
            path, leaf = next((p, x) for p, x in edl_tree.flatten(tree).items() if not _hashable(x))
            raise TypeError(
                f"TrainState: {field}.{path} holds an unhashable {type(leaf).__name__}; a "
                "non-array leaf must be hashable (it is static under jit). Store it as an "
                "array or in a static eqx field."
            ) from None

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


_FIELDS = ("params", "other", "opt_state")


def _split_field(name: str, tree: PyTree) -> tuple[tuple[Any, ...], tuple[Any, _Static]]:
    """A field's array leaves, and its metadata: the arrays' treedef and the static rest."""
    dynamic, static = eqx.partition(tree, edl_tree.is_array_like)
    leaves, treedef = jax.tree.flatten(dynamic)
    return tuple(leaves), (treedef, _Static(static, name))


@jax.tree_util.register_pytree_with_keys_class
class TrainState:
    """Training state as a frozen pytree whose leaves are exactly its arrays.

    Attributes:
        step: int32 scalar array, the number of applied updates.
        params: the trainable arrays of the model (``edl.split``'s first half).
        other: everything else in the model, same structure with ``None`` holes.
        opt_state: the optimizer state for ``params``, or ``None`` before :func:`init_tx`.

    As a pytree, a state's children are its array leaves, keyed by full path
    (``"params.layers.0.weight"``, ``"opt_state.0.mu.layers.0.weight"``). Non-array leaves (an
    activation function, a Python float in a Module) and the ``None`` holes are static
    metadata. So a state passes through plain ``jax.jit`` with donation, and
    ``jax.tree.map(f, state)`` visits arrays only, which makes sharding trees for
    ``jit(out_shardings=...)`` and path-keyed checkpoints straightforward.
    """

    __slots__ = ("_leaves", "_meta", "_views", "step")

    step: Int[Array, ""]

    def __init__(
        self, step: Int[Array, ""], params: PyTree, other: PyTree, opt_state: PyTree | None = None
    ) -> None:
        parts = [
            _split_field(n, t) for n, t in zip(_FIELDS, (params, other, opt_state), strict=True)
        ]
        self._init(step, tuple(p[0] for p in parts), tuple(p[1] for p in parts))

    def _init(self, step: Any, leaves: tuple[tuple[Any, ...], ...], meta: tuple[Any, ...]) -> None:
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "_leaves", leaves)
        object.__setattr__(self, "_meta", meta)
        object.__setattr__(self, "_views", {})

    def _view(self, name: str) -> PyTree:
        views = self._views
        if name not in views:  # built lazily: a jitted loop that never looks pays nothing
            i = _FIELDS.index(name)
            treedef, static = self._meta[i]
            views[name] = eqx.combine(jax.tree.unflatten(treedef, self._leaves[i]), static.tree)
        return views[name]

    params = property(lambda self: self._view("params"))
    other = property(lambda self: self._view("other"))
    opt_state = property(lambda self: self._view("opt_state"))

    @property
    def partition_rules(self) -> Any:
        """The model's partition rules (``edl.sharding``'s ``rules=None``): those its class
        carries (an edl model's family rules), or None."""
        for i in (0, 1):  # params, other: each has the model's structure (and class)
            rules = getattr(self._meta[i][1].tree, "partition_rules", None)
            if rules is not None:
                return rules
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TrainState is frozen; use edl.state.replace(state, {name}=...)")

    def tree_flatten(self) -> tuple[list[Any], tuple[Any, ...]]:
        return [self.step, *(x for field in self._leaves for x in field)], self._meta

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children = [(jax.tree_util.GetAttrKey("step"), self.step)]
        for name, (treedef, _), field in zip(_FIELDS, self._meta, self._leaves, strict=True):
            paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, field))[0]
            head = jax.tree_util.GetAttrKey(name)
            children += [(edl_tree.PathKey((head, *kp)), x) for kp, x in paths]
        return children, self._meta

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, ...], children: Sequence[Any]) -> TrainState:
        step, *rest = children
        leaves, start = [], 0
        for treedef, _ in meta:
            leaves.append(tuple(rest[start : start + treedef.num_leaves]))
            start += treedef.num_leaves
        state = object.__new__(cls)
        state._init(step, tuple(leaves), meta)
        return state

    def _replace(self, step: Any, **trees: PyTree) -> TrainState:
        """A new state; fields not in ``trees`` keep their leaves and metadata as they are."""
        parts = [
            _split_field(n, trees[n]) if n in trees else (self._leaves[i], self._meta[i])
            for i, n in enumerate(_FIELDS)
        ]
        state = object.__new__(type(self))
        state._init(step, tuple(p[0] for p in parts), tuple(p[1] for p in parts))
        return state

    def __repr__(self) -> str:
        def describe(i: int, name: str) -> str:
            if getattr(self, name) is None:
                return "None"
            arrays = [x for x in self._leaves[i] if edl_tree.is_array_like(x)]
            return f"<{len(arrays)} arrays, {edl_module.count_params(arrays):,} elements>"

        fields = ", ".join(f"{n}={describe(i, n)}" for i, n in enumerate(_FIELDS))
        return f"TrainState(step={self.step!r}, {fields})"


def _optax_promotion() -> contextlib.AbstractContextManager[None]:
    """optax is written for standard dtype promotion (Adam's bias correction computes
    ``decay**count`` with an int32 count); scope it to the optimizer so that users who enable
    ``jax_numpy_dtype_promotion="strict"`` for their own code can still use it."""
    return jax.numpy_dtype_promotion("standard")


def _as_step(step: int | jax.Array) -> Int[Array, ""]:
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise ValueError(
            f"step must be an integer scalar, got shape {step.shape} dtype {step.dtype}"
        )
    return step.astype(jnp.int32)


@edl_module.shows_trainable_forms
def create(
    model: PyTree,
    tx: optax.GradientTransformation | None = None,
    *,
    trainable: edl_module.Trainable = None,
    step: int | Int[Array, ""] = 0,
) -> TrainState:
    """Split ``model`` by ``trainable`` into a new state (``step``, ``params``, ``other``).

    With ``tx``, the optimizer state is initialised for the trainable arrays only.
    """
    params, other = edl_module.split(model, trainable)
    state = TrainState(step=_as_step(step), params=params, other=other)
    return state if tx is None else init_tx(state, tx)


def init_tx(state: TrainState, tx: optax.GradientTransformation) -> TrainState:
    """A state whose ``opt_state`` is ``tx.init(state.params)`` (replacing any previous one)."""
    with _optax_promotion():
        opt_state = tx.init(state.params)
    return replace(state, opt_state=opt_state)


def _check_grads(grads: PyTree, params: PyTree) -> None:
    diff = edl_tree.structure_difference(grads, params, names=("grads", "params"))
    if diff is not None:
        raise ValueError(
            f"apply_gradients: grads do not have the structure of state.params: {diff}. Take "
            "gradients with respect to state.params only (edl.state.value_and_grad)."
        )
    shapes = edl_tree.validate(grads, params, check_dtype=False).shape_mismatches
    if shapes:
        path, want, got = shapes[0]
        raise ValueError(
            f"apply_gradients: the gradient at {path!r} has shape {got}, params {want}"
        )


def apply_gradients(
    state: TrainState, grads: PyTree, tx: optax.GradientTransformation
) -> TrainState:
    """One optimizer update: ``params <- params + tx.update(grads)``, ``step <- step + 1``.

    Pure, so it works under ``jax.jit`` / ``eqx.filter_jit`` with the state donated.
    Raises ``ValueError`` if the optimizer is not initialised or if ``grads`` does not have
    ``state.params``' structure (the message names the first mismatching path).
    """
    if state.opt_state is None:
        raise ValueError(
            "apply_gradients: the state has no optimizer state; create it with "
            "edl.state.create(model, tx) or edl.state.init_tx(state, tx)"
        )
    _check_grads(grads, state.params)
    with _optax_promotion():
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    return state._replace(state.step + 1, params=params, opt_state=opt_state)


def model(state: TrainState) -> PyTree:
    """The full model: ``edl.merge(state.params, state.other)``."""
    return edl_module.merge(state.params, state.other)


def replace(state: TrainState, **fields: Any) -> TrainState:
    """A copy of ``state`` with ``fields`` replaced (unknown names raise ``TypeError``)."""
    known = ("step", *_FIELDS)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"replace: TrainState has no field(s) {unknown}; fields are {list(known)}")
    step = _as_step(fields.pop("step")) if "step" in fields else state.step
    return state._replace(step, **fields)


class StateLayout(NamedTuple):
    """Where a state's ``other`` arrays sit among its pytree leaves (hashable: a jit cache
    key). Made by :func:`split_other`, read by :func:`join_other`."""

    treedef: Any
    other_start: int


def split_other(state: TrainState) -> tuple[StateLayout, tuple[Any, ...], tuple[Any, ...]]:
    """``(layout, updated, other)``: the state's arrays in two groups.

    ``updated`` holds what a train step replaces (``step``, ``params``, ``opt_state``),
    ``other`` the frozen arrays it passes through. A jitted step takes them as separate
    arguments so that it can donate ``updated`` without deleting ``other``, whose arrays the
    caller's model still shares (a LoRA base, frozen layers)::

        @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
        def train_step(layout, updated, other, batch):
            state = edl.state.join_other(layout, updated, other)
            ...
            return edl.state.split_other(new_state)[1], loss

        layout, updated, other = edl.state.split_other(state)
        updated, loss = train_step(layout, updated, other, batch)
        state = edl.state.join_other(layout, updated, other)  # the same ``other`` arrays

    ``edl.train.make_train_step`` does this.
    """
    leaves, treedef = jax.tree.flatten(state)
    start = 1 + len(state._leaves[0])  # leaves: step, params..., other..., opt_state...
    stop = start + len(state._leaves[1])
    updated = (*leaves[:start], *leaves[stop:])
    return StateLayout(treedef, start), updated, tuple(leaves[start:stop])


def join_other(layout: StateLayout, updated: Sequence[Any], other: Sequence[Any]) -> TrainState:
    """The inverse of :func:`split_other`: the state whose leaves are ``updated`` and
    ``other`` (the very arrays given, nothing copied)."""
    start = layout.other_start
    leaves = (*updated[:start], *other, *updated[start:])
    if len(leaves) != layout.treedef.num_leaves:
        raise ValueError(
            f"join_other: the layout holds {layout.treedef.num_leaves} arrays, got "
            f"{len(updated)} updated + {len(other)} other"
        )
    return jax.tree.unflatten(layout.treedef, leaves)


def size(state: TrainState) -> int:
    """Bytes held by the state's arrays (params, other and optimizer state)."""
    return edl_module.nbytes(state)


def value_and_grad(
    loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, PyTree]]:
    """Differentiate ``loss_fn(model, *args, **kwargs)`` with respect to ``state.params`` only.

    Returns ``f(state, *args, **kwargs) -> (value, grads)`` where ``grads`` has the structure
    of ``state.params`` (ready for :func:`apply_gradients`) and ``value`` is ``loss`` or
    ``(loss, aux)`` as with ``jax.value_and_grad``.
    """

    def wrapped(state: TrainState, *args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        def of_params(params: PyTree) -> Any:
            return loss_fn(edl_module.merge(params, state.other), *args, **kwargs)

        return jax.value_and_grad(of_params, has_aux=has_aux)(state.params)

    return wrapped
