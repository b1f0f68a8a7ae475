"""Optimizers by name: ``OPTIMIZERS``, a registry of optax transformations built from an
:class:`OptimizerConfig`, and the learning-rate schedule they share.

Each entry is an :class:`Optimizer` (``name``, ``build(config, schedule) -> tx``); the
``edl train --optimizer`` choices, ``OptimizerConfig``'s check and the docs read the
registry, so a new optimizer is one entry. Clipping and gradient accumulation are
``make_train_step``'s, around whichever optimizer.

Muon (``"muon"``, ``optax.contrib.muon``) orthogonalises the momentum of the hidden weight
matrices and runs AdamW on everything else. Which leaf goes where (:func:`muon_dimensions`)
is decided by the layer a leaf belongs to and its key path, never by its rank alone: in a
layer stack a norm's scale is ``(layers, dim)`` and a bias ``(layers, out)``, 2-D arrays
that are not matrices.

- Muon: the ``weight`` of every ``edl.nn.Linear`` (attention and MLP projections, a MoE
  router, LoRA's ``lora_A`` / ``lora_B``, vision projectors) and the arrays of a MoE's
  ``Experts``. Their last two axes are ``(out, in)``: each layer's (and each expert's)
  matrix is orthogonalised on its own, leading stack axes being batch axes
  (``MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)``); optax's default would
  treat a 3-D stack as no matrix, and the ``(0, 1)`` rule would orthogonalise across layers.
- AdamW: embeddings (``Embedding``), the output heads (``lm_head``, a classifier's
  ``score``: one row per token / label, where a whitened update means nothing), norms,
  biases, convolutions, and any other array.

Weight decay (AdamW, Lion, both halves of Muon) skips biases and norm scales, as
transformers' ``Trainer`` does (``get_decay_parameter_names``): :func:`weight_decay_mask`
applies its name patterns to edl's key paths (which keep HF's module names) and skips every
leaf of edl's norm layers by type, as the Trainer skips ``nn.LayerNorm``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree
from optax.contrib import MuonDimensionNumbers, muon
from optax.transforms import MaskedNode

from edl import tree as edl_tree
from edl._registry import Registry
from edl.nn.gated_deltanet import GatedRMSNorm
from edl.nn.layers import LayerNorm, Linear, RMSNorm
from edl.nn.moe import Experts
from edl.train.options import SCHEDULES, MuonConfig

__all__ = [
    "OPTIMIZERS",
    "Optimizer",
    "OptimizerConfig",
    "make_optimizer",
    "make_schedule",
    "muon_dimensions",
    "weight_decay_mask",
]

ADAMW_LAYERS = ("lm_head", "score")
"""Attribute names of ``Linear`` layers that Muon leaves to AdamW: the output heads."""

MATRIX = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)
"""A ``(..., out, in)`` weight: one matrix per index of the leading (stack) axes."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer and learning-rate schedule, by name.

    ``name``: an entry of :data:`OPTIMIZERS` (``adamw``, ``adafactor``, ``lion``, ``sgd``,
    ``muon``). ``schedule``: ``"cosine"`` (warmup then cosine decay to ``min_lr_ratio *
    learning_rate`` at ``total_steps``), ``"linear"`` (warmup then linear decay to the same
    floor) or ``"constant"`` (warmup then flat). ``weight_decay`` applies to AdamW, Lion
    and both halves of Muon, on every leaf but biases and norm scales
    (:func:`weight_decay_mask`); ``b1`` / ``b2`` / ``eps`` to Adam(W), Lion and Muon's AdamW
    leaves; ``muon`` holds Muon's own options.
    """

    name: str = "adamw"
    learning_rate: float = 3e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    muon: MuonConfig = MuonConfig()

    def __post_init__(self):
        OPTIMIZERS.lookup(self.name, "OptimizerConfig.name")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"OptimizerConfig.schedule: unknown {self.schedule!r}; choose one of "
                f"{', '.join(SCHEDULES)}"
            )
        if self.total_steps < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"OptimizerConfig: need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps "
                f"({self.total_steps}) and total_steps >= 1"
            )
        ranges = {
            "learning_rate": (0.0, None),
            "weight_decay": (0.0, None),
            "eps": (0.0, None),
            "min_lr_ratio": (0.0, 1.0),
            "b1": (0.0, 1.0),
            "b2": (0.0, 1.0),
            "momentum": (0.0, 1.0),
        }
        for field, (low, high) in ranges.items():
            value = getattr(self, field)
            if not low <= value <= (math.inf if high is None else high):
                bound = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"OptimizerConfig.{field} must be {bound}, got {value}")


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The learning rate as a function of the optimizer step (counted from 0).

    Warmup rises linearly over ``warmup_steps`` steps to the peak, from ``peak /
    warmup_steps`` at step 0: every step moves the weights (a warmup from 0, as transformers'
    ``get_*_schedule_with_warmup``, spends its first step at learning rate 0). Then the main
    schedule runs from the peak over the remaining ``total_steps - warmup_steps``."""
    peak, floor = config.learning_rate, config.learning_rate * config.min_lr_ratio
    decay_steps = max(1, config.total_steps - config.warmup_steps)
    if config.schedule == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
    elif config.schedule == "linear":
        main = optax.linear_schedule(peak, floor, decay_steps)
    elif config.schedule == "constant":
        main = optax.constant_schedule(peak)
    else:
        raise ValueError(f"OptimizerConfig.schedule: unknown {config.schedule!r}")
    if config.warmup_steps == 0:
        return main
    first = peak / config.warmup_steps  # step k of the warmup: peak * (k + 1) / warmup_steps
    if config.warmup_steps == 1:
        return optax.join_schedules([optax.constant_schedule(first), main], [1])
    warmup = optax.linear_schedule(first, peak, config.warmup_steps - 1)
    return optax.join_schedules([warmup, main], [config.warmup_steps])


def _matrix_paths(params: PyTree) -> set[str]:
    """Key paths of the leaves Muon takes: every ``Linear``'s ``weight`` outside the
    output heads, and every array of an ``Experts``."""
    is_layer = lambda x: isinstance(x, Linear | Experts)
    found = set()
    for keypath, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_layer)[0]:
        path = edl_tree.path_str(keypath)
        if isinstance(node, Linear) and path.rsplit(".", 1)[-1] not in ADAMW_LAYERS:
            found.add(f"{path}.weight")
        elif isinstance(node, Experts):
            found |= {f"{path}.{name}" for name in ("gate_proj", "up_proj", "down_proj")}
    return found


NO_DECAY_PATTERN = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
"""transformers' ``Trainer.get_decay_parameter_names`` name patterns (searched in the
lower-cased key path): biases and norms."""

NORM_LAYERS = (RMSNorm, LayerNorm, GatedRMSNorm)


def weight_decay_mask(params: PyTree) -> PyTree[bool]:
    """``params``' structure with ``True`` at the leaves weight decay applies to: every leaf
    but those whose key path matches :data:`NO_DECAY_PATTERN` and those inside a
    :data:`NORM_LAYERS` layer (whatever its attribute name)."""
    is_norm = lambda x: isinstance(x, NORM_LAYERS)
    norms = {
        edl_tree.path_str(keypath)
        for keypath, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_norm)[0]
        if is_norm(node)
    }

    def decays(keypath, _) -> bool:
        path = edl_tree.path_str(keypath)
        if NO_DECAY_PATTERN.search(path.lower()):
            return False
        return not any(path == n or path.startswith(f"{n}.") for n in norms)

    return jax.tree_util.tree_map_with_path(decays, params)


def _decoupled_weight_decay(
    rate: float, schedule: optax.Schedule, mask: Callable[[PyTree], PyTree[bool]]
) -> optax.GradientTransformation:
    """Subtract ``schedule(step) * rate * param`` from the (already learning-rate scaled)
    updates of the leaves ``mask`` selects: AdamW's decoupled decay, for Muon's AdamW leaves
    (``optax.contrib.muon`` takes no mask for them)."""

    def init(params: PyTree) -> optax.ScaleByScheduleState:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the parameters: pass params to tx.update")
        lr = schedule(state.count)

        def one(u, p, decays):
            return u - (lr * rate * p).astype(u.dtype) if decays else u

        new = jax.tree.map(one, updates, params, mask(params))
        return new, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def muon_dimensions(params: PyTree) -> PyTree[MuonDimensionNumbers | None]:
    """``params``' structure with :data:`MATRIX` at the leaves Muon orthogonalises and
    ``None`` at those AdamW updates (the module docstring says which and why).

    ``optax.contrib.muon``'s ``muon_weight_dimension_numbers``: it calls this on the
    parameters, the gradients, and the gradients with AdamW's leaves masked out
    (``MaskedNode``), so it reads layers and key paths, which all three share."""
    matrices = _matrix_paths(params)

    def spec(keypath, leaf):
        if isinstance(leaf, MaskedNode) or edl_tree.path_str(keypath) not in matrices:
            return None
        if leaf.ndim < 2:
            raise ValueError(
                f"muon: {edl_tree.path_str(keypath)} is a matrix weight of shape {leaf.shape}; "
                "expected (..., out, in)"
            )
        return MATRIX

    is_masked = lambda x: isinstance(x, MaskedNode)
    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_masked)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An entry of :data:`OPTIMIZERS`: ``build(config, schedule)`` gives the optax
    transformation (without clipping, which ``make_train_step`` adds)."""

    name: str
    build: Callable[[OptimizerConfig, optax.Schedule], optax.GradientTransformation]
    help: str


def _muon(c: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    m = c.muon
    tx = muon(
        lr,
        ns_steps=m.ns_steps,
        beta=m.beta,
        eps=c.eps,
        weight_decay=c.weight_decay,
        weight_decay_mask=weight_decay_mask,
        nesterov=m.nesterov,
        adam_b1=c.b1,
        adam_b2=c.b2,
        muon_weight_dimension_numbers=muon_dimensions,
        consistent_rms=m.consistent_rms or None,
    )
    if not c.weight_decay:
        return tx

    def adamw_leaves_that_decay(params: PyTree) -> PyTree[bool]:
        matrices = _matrix_paths(params)

        def one(keypath, decays: bool) -> bool:
            return decays and edl_tree.path_str(keypath) not in matrices

        return jax.tree_util.tree_map_with_path(one, weight_decay_mask(params))

    return optax.chain(tx, _decoupled_weight_decay(c.weight_decay, lr, adamw_leaves_that_decay))


OPTIMIZERS: Registry[Optimizer] = Registry(
    "optimizer",
    [
        Optimizer(
            "adamw",
            lambda c, lr: optax.adamw(
                lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=weight_decay_mask
            ),
            "optax.adamw",
        ),
        Optimizer("adafactor", lambda c, lr: optax.adafactor(lr), "optax.adafactor"),
        Optimizer(
            "lion",
            lambda c, lr: optax.lion(
                lr, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay, mask=weight_decay_mask
            ),
            "optax.lion",
        ),
        Optimizer("sgd", lambda c, lr: optax.sgd(lr, momentum=c.momentum), "optax.sgd"),
        Optimizer(
            "muon",
            _muon,
            "optax.contrib.muon on the hidden weight matrices, AdamW on the rest",
        ),
    ],
)
"""The optimizers by name; ``OptimizerConfig.name`` and ``edl train --optimizer`` read it."""


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)`` for ``config``; clipping is done by ``make_train_step``."""
    lr = make_schedule(config)
    return OPTIMIZERS.lookup(config.name, "OptimizerConfig.name").build(config, lr), lr
