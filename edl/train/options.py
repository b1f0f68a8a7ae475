"""The named choices of the training options, and the optimizers' option sections, in a
module that imports no jax (the ``edl`` command lists them in ``--help`` before it loads)."""

from __future__ import annotations

import dataclasses

from edl._settings import check_options, option

__all__ = ["NAN_POLICIES", "SCHEDULES", "TRACKERS", "MuonConfig"]

SCHEDULES = ("cosine", "linear", "constant")
"""``OptimizerConfig.schedule``: the learning rate after warmup."""
NAN_POLICIES = ("stop", "skip")
"""``NonFiniteConfig.policy`` (``nan_policy``): raise at a non-finite step, or go on past
skipped ones."""
TRACKERS = ("tensorboard", "wandb")
"""``LogConfig.trackers``: where metrics go besides ``metrics.jsonl`` (always written)."""


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """``optimizer="muon"``'s own options (``optax.contrib.muon``); the learning rate,
    schedule, weight decay and AdamW's ``b1`` / ``b2`` / ``eps`` are ``OptimizerConfig``'s.

    ``consistent_rms`` 0.2 (Moonlight's, "Muon is Scalable for LLM Training") scales each
    orthogonalised update to AdamW's RMS, so one learning rate and weight decay serve the
    Muon and the AdamW leaves; 0 gives Keller Jordan's ``sqrt(max(1, out / in))`` instead,
    which wants a learning rate ~50x AdamW's."""

    beta: float = option(0.95, "Muon's momentum decay", name="muon_beta", low=0.0, high=1.0)
    ns_steps: int = option(
        5, "Newton-Schulz iterations per orthogonalisation", name="muon_ns_steps", low=1
    )
    consistent_rms: float = option(
        0.2,
        "scale Muon's updates to this RMS (0.2: AdamW's, so one learning rate serves both; "
        "0: width scaling sqrt(max(1, out/in)))",
        name="muon_consistent_rms",
        low=0.0,
    )
    nesterov: bool = option(
        True,
        "Nesterov momentum (Muon's and, as optax does, the AdamW leaves')",
        name="muon_nesterov",
    )

    def __post_init__(self) -> None:
        check_options(self)
