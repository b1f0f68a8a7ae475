"""The named choices of the training options, in a module that imports nothing (the ``edl``
command lists them in ``--help`` without loading jax)."""

__all__ = ["NAN_POLICIES", "OPTIMIZERS", "SCHEDULES", "TRACKERS"]

OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
"""``OptimizerConfig.name``: optax's ``adamw``, ``adafactor``, ``lion``, ``sgd``."""
SCHEDULES = ("cosine", "linear", "constant")
"""``OptimizerConfig.schedule``: the learning rate after warmup."""
NAN_POLICIES = ("stop", "skip")
"""``NonFiniteConfig.policy`` (``nan_policy``): raise at a non-finite step, or go on past
skipped ones."""
TRACKERS = ("tensorboard", "wandb")
"""``LogConfig.trackers``: where metrics go besides ``metrics.jsonl`` (always written)."""
