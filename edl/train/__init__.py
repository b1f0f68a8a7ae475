"""Training: train/eval steps, the loop (a small core plus callbacks), and the data pipeline
(byte tokenizer, default corpus, collators, resumable batch iterators).

Names load on first use (``edl._lazy``), so the ``edl`` command reads its option choices
from here without importing jax.
"""

from edl._lazy import lazy_attributes

_MODULES = {
    "edl.train.callbacks": ("NonFiniteLossError",),
    "edl.train.core": (
        "Callback",
        "RunEnd",
        "RunStart",
        "StepInfo",
        "StepStart",
        "Stop",
        "callback",
        "run_loop",
    ),
    "edl.train.data": (
        "IGNORE_INDEX",
        "EpochCursor",
        "Resumable",
        "TokenBatches",
        "batches_from_iterable",
        "pack_sequences",
        "pad_batch",
    ),
    "edl.train.grpo": (
        "GRPOConfig",
        "GRPOStep",
        "PromptBatches",
        "RewardFn",
        "make_grpo_step",
        "score_completions",
    ),
    "edl.train.grpo_objective": (
        "completion_logprobs",
        "completion_mask",
        "group_advantages",
        "grpo_loss",
        "kl_k3",
    ),
    "edl.train.jitted": ("Step", "StepProgram"),
    "edl.train.loop": ("train",),
    "edl.train.options": ("NAN_POLICIES", "OPTIMIZERS", "SCHEDULES"),
    "edl.train.preference": ("dpo_loss", "orpo_loss", "sequence_logps", "simpo_loss"),
    "edl.train.preference_data": ("PREFERENCE_KEYS", "PreferenceBatches", "preference_rows"),
    "edl.train.preference_step": (
        "make_dpo_step",
        "make_reward_step",
        "preference_logps",
        "reference_logps",
        "reward_loss",
    ),
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
    "edl.train.step": (
        "OptimizerConfig",
        "all_finite",
        "global_norm",
        "make_eval_step",
        "make_optimizer",
        "make_schedule",
        "make_train_step",
    ),
    "edl.train.text": (
        "ByteTokenizer",
        "Tokenizer",
        "default_corpus_files",
        "load_corpus",
        "split_corpus",
    ),
}
_EXPORTS = {name: f"{module}:{name}" for module, names in _MODULES.items() for name in names}

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
