"""split / merge and model utilities over any Equinox pytree.

EasyDeL keeps a model as ``graphdef + graphstate + graphother``. In edl the model *is* the
pytree, and::

    params, other = edl.split(model)          # trainable arrays | everything else
    model = edl.merge(params, other)          # exact inverse

Both halves have the model's structure with ``None`` in the other half's places, and share
the model's leaves (nothing is copied), so freezing most of a large model costs nothing.
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from collections.abc import Callable
from typing import Any, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree

from edl import tree as edl_tree

__all__ = [
    "TRAINABLE_FORMS",
    "Trainable",
    "abstract",
    "count_params",
    "merge",
    "nbytes",
    "split",
    "summary",
    "to_bfloat16",
    "to_dtype",
    "to_float",
    "to_half",
    "trainable_mask",
]

# The last member is meant as PyTree[bool]; it is typed loosely so that a bad mask reaches
# edl's own check, which names the offending leaf.
Trainable: TypeAlias = (
    Callable[[Any], bool] | Callable[[str, Any], bool] | str | re.Pattern[str] | PyTree | None
)

TRAINABLE_FORMS = """``trainable`` takes one of these forms:

    None                         every floating-point array (the default)
    r"lora_[AB]"                 a regex (str or re.Pattern), searched in each leaf's path
                                 string, e.g. "layers.3.self_attn.q_proj.weight"
    lambda path, leaf: ...       a predicate of the path string and the leaf
    lambda leaf: ...             a predicate of the leaf alone
    a pytree of Python bools     a prefix of the model: True trains the whole subtree

Whatever is given is narrowed to inexact (floating / complex) arrays: nothing else can
carry a gradient. Example, everything but the embeddings::

    edl.split(model, lambda path, leaf: not path.startswith("model.embed_tokens."))
"""

"""What may be trained (``split``, ``create_state``, ``summary``): see ``TRAINABLE_FORMS``."""


def shows_trainable_forms(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Append ``TRAINABLE_FORMS`` to ``fn``'s docstring, so ``help(fn)`` shows them inline."""
    fn.__doc__ = f"{fn.__doc__.rstrip()}\n\n{textwrap.indent(TRAINABLE_FORMS, '    ')}"
    return fn


def is_inexact_array_like(x: Any) -> bool:
    """True for floating/complex arrays and ``ShapeDtypeStruct``s (abstract models split too)."""
    return edl_tree.is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


@shows_trainable_forms
def trainable_mask(model: PyTree, trainable: Trainable = None, *, sep: str = ".") -> PyTree[bool]:
    """A bool per leaf of ``model``: True where the leaf is trainable."""
    if trainable is None:
        return jax.tree.map(is_inexact_array_like, model)
    if isinstance(trainable, str | re.Pattern):
        pattern = edl_tree.compile_pattern(trainable)
        return edl_tree.named_map(
            lambda p, x: is_inexact_array_like(x) and pattern.search(p) is not None, model, sep=sep
        )
    if callable(trainable) and not isinstance(trainable, eqx.Module):
        if _takes_path(trainable):
            return edl_tree.named_map(
                lambda p, x: is_inexact_array_like(x) and bool(trainable(p, x)), model, sep=sep
            )
        return jax.tree.map(lambda x: is_inexact_array_like(x) and bool(trainable(x)), model)
    return _broadcast_bool_prefix(trainable, model, sep)


def _takes_path(predicate: Callable[..., Any]) -> bool:
    """Whether a ``trainable`` predicate takes ``(path, leaf)`` (two required positional
    parameters) rather than ``(leaf)``; any other signature is refused, naming it."""
    try:
        signature = inspect.signature(predicate)
    except (TypeError, ValueError):  # a builtin without a signature: called with the leaf
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p for p in signature.parameters.values() if p.kind in positional and p.default is p.empty
    ]
    if len(required) in (1, 2):
        return len(required) == 2
    if not required and any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        return False
    raise TypeError(
        f"trainable: the predicate {predicate!r} has signature {signature}; it must take "
        "(leaf) or (path, leaf)"
    )


def _broadcast_bool_prefix(mask: PyTree, model: PyTree, sep: str) -> PyTree[bool]:
    def check(path: str, b: Any) -> bool:
        if not isinstance(b, bool | np.bool_):
            raise TypeError(
                f"trainable mask: leaf {path!r} is {type(b).__name__}; a bool pytree must hold "
                "only Python bools"
            )
        return bool(b)

    mask = edl_tree.named_map(check, mask, sep=sep)
    try:
        return jax.tree.map(
            lambda b, sub: jax.tree.map(lambda x: b and is_inexact_array_like(x), sub), mask, model
        )
    except ValueError as e:
        raise ValueError(f"trainable mask is not a prefix of the model's structure: {e}") from e


@shows_trainable_forms
def split(model: PyTree, trainable: Trainable = None, *, sep: str = ".") -> tuple[PyTree, PyTree]:
    """Split ``model`` into ``(params, other)``: the trainable arrays and everything else.

    Both have ``model``'s structure with ``None`` holes where the other holds a value; the
    leaves are ``model``'s own objects (no copies). ``merge(params, other)`` is the inverse.

    Args:
        model: any pytree, typically an ``eqx.Module``.
        trainable: what to train (the forms below); default: every inexact array.
    """
    return eqx.partition(model, trainable_mask(model, trainable, sep=sep))


def merge(params: PyTree, other: PyTree) -> PyTree:
    """Put ``split``'s halves back together (EasyDeL's ``merge_module``).

    Raises ``ValueError`` naming the first path where the two halves' structures differ, or
    where both hold a value (they would silently shadow each other).
    """
    diff = edl_tree.structure_difference(
        params, other, names=("params", "other"), none_is_leaf=True
    )
    if diff is not None:
        raise ValueError(f"merge: params and other differ in structure: {diff}")
    both = [
        kp
        for (kp, p), o in zip(
            jtu.tree_flatten_with_path(params, is_leaf=edl_tree.is_none)[0],
            jax.tree.leaves(other, is_leaf=edl_tree.is_none),
            strict=True,
        )
        if p is not None and o is not None
    ]
    if both:
        raise ValueError(
            f"merge: params and other both hold a value at {edl_tree.path_str(both[0])!r} "
            f"({len(both)} such paths); merge takes the two halves returned by split"
        )
    return eqx.combine(params, other)


def require_float_dtype(dtype: DTypeLike | type, what: str) -> np.dtype:
    """``dtype`` as a numpy dtype when it is a floating one (float32, bfloat16, float16,
    float8 ...); otherwise ``ValueError`` naming ``what`` (the argument, e.g.
    ``"from_pretrained: dtype"``) and the dtype given. Casting weights to an integer or
    boolean dtype truncates them to (mostly) zeros, so arguments meant as a float dtype
    are checked with this before anything is cast."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{what} must be a floating dtype, got {dtype!r} ({e})") from e
    if not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(
            f"{what} must be a floating dtype such as float32 or bfloat16, got {resolved.name}"
        )
    return resolved


def to_dtype(tree: PyTree, dtype: DTypeLike | type) -> PyTree:
    """Cast every floating leaf (arrays and ShapeDtypeStructs) to ``dtype``, which must be a
    floating dtype (else ``ValueError``); other leaves are kept."""
    dtype = require_float_dtype(dtype, "to_dtype: dtype")

    def cast(x: Any) -> Any:
        if not (edl_tree.is_array_like(x) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def to_float(tree: PyTree) -> PyTree:
    """Floating leaves to float32 (torch's ``.float()``)."""
    return to_dtype(tree, jnp.float32)


def to_half(tree: PyTree) -> PyTree:
    """Floating leaves to float16 (torch's ``.half()``)."""
    return to_dtype(tree, jnp.float16)


def to_bfloat16(tree: PyTree) -> PyTree:
    """Floating leaves to bfloat16."""
    return to_dtype(tree, jnp.bfloat16)


def _array_leaves(tree: PyTree) -> list[Any]:
    return [x for x in jax.tree.leaves(tree) if edl_tree.is_array_like(x)]


def count_params(tree: PyTree) -> int:
    """Number of array elements in ``tree`` (``count_params(split(m)[0])`` counts trainables)."""
    return sum(math.prod(x.shape) for x in _array_leaves(tree))


def _bits(dtype: np.dtype) -> int:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return np.dtype(dtype).itemsize * 8


def nbytes(tree: PyTree) -> int:
    """Bytes held by the arrays of ``tree`` (sub-byte dtypes such as int4 count their bits)."""
    return sum(-(-math.prod(x.shape) * _bits(x.dtype) // 8) for x in _array_leaves(tree))


def abstract(model_init: Callable[..., PyTree], *args: Any, **kwargs: Any) -> PyTree:
    """Shape-only init: ``model_init(*args, **kwargs)`` with ``jax.ShapeDtypeStruct`` leaves.

    Nothing is allocated; use it with ``edl.tree.load_into`` to load weights, or to plan
    shardings. Non-array arguments (config, ints) pass through as static.
    """
    return eqx.filter_eval_shape(model_init, *args, **kwargs)


def _human(n: int | float, unit: str = "") -> str:
    if abs(n) < 1000:
        return f"{n:.0f}{unit}"
    for suffix in ("K", "M", "G"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.2f}{suffix}{unit}"
    return f"{n / 1000:.2f}T{unit}"


@shows_trainable_forms
def summary(
    model: PyTree,
    trainable: Trainable = None,
    *,
    sep: str = ".",
    max_rows: int | None = None,
    trainable_only: bool = False,
) -> str:
    """A table of the model's arrays: path, shape, dtype, element count, trainable, and totals.

    Trainable rows come first (each group in the model's order), so a shortened table shows
    what trains; ``trainable_only`` lists only those (the totals still count every array).
    ``max_rows`` keeps the first and last rows of very long tables.
    """
    mask = edl_tree.flatten(trainable_mask(model, trainable, sep=sep), sep)
    arrays = {p: x for p, x in edl_tree.flatten(model, sep).items() if edl_tree.is_array_like(x)}
    listed = sorted(arrays, key=lambda p: not mask[p])  # stable: the model's order per group
    if trainable_only:
        listed = [p for p in listed if mask[p]]
    rows = [
        (p, str(tuple(x.shape)), str(x.dtype), f"{math.prod(x.shape):,}", "yes" if mask[p] else "")
        for p, x in ((p, arrays[p]) for p in listed)
    ]
    header = ("path", "shape", "dtype", "params", "trainable")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def fmt(r: tuple[str, ...]) -> str:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2])]
        return "  ".join([*cells, r[3].rjust(widths[3]), r[4]]).rstrip()

    shown = [fmt(r) for r in rows]
    if max_rows is not None and len(shown) > max_rows:
        head, tail = (max_rows + 1) // 2, max_rows // 2
        shown = [
            *shown[:head],
            f"... {len(rows) - head - tail} more rows ...",
            *shown[len(shown) - tail :],
        ]
    total = count_params(list(arrays.values()))
    n_train = count_params([x for p, x in arrays.items() if mask[p]])
    rule = "-" * len(fmt(header))
    footer = (
        f"total: {total:,} params ({_human(total)}), trainable: {n_train:,} ({_human(n_train)}), "
        f"{_human(nbytes(model), 'B')}"
    )
    return "\n".join([fmt(header), rule, *shown, rule, footer])
