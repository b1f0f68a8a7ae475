"""Training: train/eval steps, the loop (a small core plus callbacks), and the data pipeline
(byte tokenizer, default corpus, collators, resumable batch iterators).

Names load on first use (``edl._lazy``), so the ``edl`` command reads its option choices
from here without importing jax. The names here are what a training script imports; the
rest is in the defining module: the loop's events (``edl.train.core``), the data pipeline's
pieces (``edl.train.data``), the preference losses and GRPO's objective
(``edl.train.preference``, ``edl.train.grpo_objective``), the step program
(``edl.train.jitted``), the option tables (``edl.train.options``), the optimizer registry
(``edl.train.optimizers``).
"""

from edl._lazy import lazy_attributes

_MODULES = {
    "edl.train.core": ("Callback", "StepInfo", "Stop", "callback", "run_loop"),
    "edl.train.data": ("TokenBatches", "batches_from_iterable"),
    "edl.train.distill": ("make_distill_step",),
    "edl.train.distill_data": ("DistillBatches",),
    "edl.train.distill_loss": ("distill_loss",),
    "edl.train.environments": ("Environment", "ToolEnvironment"),
    "edl.train.grpo": ("GRPOConfig", "PromptBatches", "make_grpo_step"),
    "edl.train.kto": ("kto_loss", "make_kto_step"),
    "edl.train.loop": ("train",),
    "edl.train.post_eval": ("make_dpo_eval_step", "make_kto_eval_step", "make_reward_eval_step"),
    "edl.train.preference": ("dpo_loss",),
    "edl.train.preference_data": ("PreferenceBatches",),
    "edl.train.preference_step": ("make_dpo_step", "make_reward_step"),
    "edl.train.run_config": (
        "CheckpointConfig",
        "EvalConfig",
        "LogConfig",
        "NonFiniteConfig",
        "ProfileConfig",
        "RunConfig",
        "ThroughputConfig",
        "TimeLimitConfig",
    ),
    "edl.train.optimizers": ("OPTIMIZERS", "OptimizerConfig", "make_optimizer"),
    "edl.train.step": ("make_eval_step", "make_train_step"),
    "edl.train.text": ("ByteTokenizer", "load_corpus", "split_corpus"),
}
_EXPORTS = {name: f"{module}:{name}" for module, names in _MODULES.items() for name in names}

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
