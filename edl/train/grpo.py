"""GRPO (group relative policy optimisation) as a step function for ``edl.train.train``.

    step = make_grpo_step(tx, tokenizer, [reward_fn], GRPOConfig(num_generations=8), key=key)
    run = edl.train.RunConfig(steps=200, output_dir=run_dir)
    state, summary = edl.train.train(state, step, prompt_batches, run)

Each call ``step(state, prompts)`` (``prompts``: a list of strings) does one GRPO iteration:

1. rollout: ``num_generations`` completions per prompt, sampled by ``edl.generate.generate``
   (compiled decode loop, KV cache; or, with ``rollout_backend="engine"``, the serving
   engine: ``edl.train.rollout_backends``) from ``edl.state.model(state)``, the state's own arrays:
   the sampler and the train step are pure functions of the same parameter pytree, so there
   is no weight copy and no trainer/engine synchronisation;
2. rewards: plain Python callables over decoded text and token ids (:data:`RewardFn`),
   weighted and summed, then group-normalised advantages (``group_advantages``);
3. scoring: one jitted forward pass for the old-policy log-probs (only when
   ``num_iterations > 1``; with one iteration the ratio is 1 and, as in TRL, the current
   log-probs under ``stop_gradient`` stand in) and, with ``beta > 0``, the reference's.
   ``edl.generate`` returns tokens, not their log-probs, and it samples from processed
   logits (temperature, top-k/p), so the sampler's own numbers are not the policy's; the
   forward pass gives exactly the log-probs the loss differentiates (logits / temperature,
   TRL's convention, with top-k / top-p off by default so sampling draws from that policy);
4. ``num_iterations`` optimiser updates (``make_train_step`` with ``grpo_loss`` of
   ``config.loss_type``, ``edl.train.grpo_losses``; ``gradient_accumulation_steps``
   micro-batches each) on the same rollouts; ``state.step`` then advances by one, so
   ``train``'s ``steps``, checkpoints and resume count GRPO iterations. The optax schedule
   counts updates: size ``OptimizerConfig.total_steps`` as ``steps * num_iterations``.

The reference for the KL term (``beta > 0``): ``reference="lora_base"`` (default) is the
model with its LoRA adapters dropped (``edl.lora.unwrap_lora``: the frozen base, shared,
free); or pass a frozen model pytree of the same architecture. The sampling key for step
``s`` is ``fold_in(key, s)``, so a resumed run samples what the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from edl import lora as edl_lora
from edl import state as edl_state
from edl.generate.steps import CausalLM
from edl.state import TrainState
from edl.text.sources import validate_prompt
from edl.text.tokenizer import Tokenizer
from edl.train.data import EpochCursor
from edl.train.environments import EnvironmentFactory
from edl.train.grpo_dynamic import dynamic_batch
from edl.train.grpo_losses import IMPORTANCE_SAMPLING_LEVELS
from edl.train.grpo_objective import (
    GRPO_LOSSES,
    SCALE_REWARDS,
    completion_logprobs,
    completion_mask,
    group_advantages,
    grpo_loss,
    truncated_rows,
)
from edl.train.grpo_rewards import RewardFn, score_completions
from edl.train.grpo_tools import check_environment, tool_rollout
from edl.train.rollout_backends import ROLLOUT_BACKENDS
from edl.train.step import make_train_step

__all__ = ["GRPOConfig", "GRPOStep", "PromptBatches", "make_grpo_step"]

Prompt = str | Sequence[Mapping[str, Any]] | Mapping[str, Any]
"""One GRPO prompt: text, chat messages (through the tokenizer's chat template with the
generation prompt), or a record whose ``"prompt"`` is either, with extra reward columns."""


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO settings; names and defaults as TRL's ``GRPOConfig`` where it has them.

    ``num_generations`` completions per prompt of at most ``max_new_tokens`` tokens, sampled
    at ``temperature`` (``top_k`` None and ``top_p`` 1: the full distribution, TRL's
    default). ``beta``: KL coefficient (TRL default 0: no reference). ``epsilon`` /
    ``epsilon_high`` (None: ``epsilon``): the clip range. ``num_iterations``: optimiser
    updates per batch of rollouts (mu). ``loss_type``: a name in
    ``edl.train.grpo_losses.GRPO_LOSSES``: ``"dapo"`` (TRL's default), ``"grpo"``,
    ``"bnpo"``, ``"dr_grpo"``, ``"cispo"``, ``"sapo"``, ``"luspo"``, ``"vespo"``, or a
    registered one. ``importance_sampling_level``: ``"token"`` or ``"sequence"`` (GSPO).
    ``delta`` (None: off): INTELLECT-2's cap on the unclipped ratio.
    ``sapo_temperature_pos`` / ``_neg``, ``vespo_k_pos`` / ``vespo_lambda_pos`` /
    ``vespo_k_neg`` / ``vespo_lambda_neg``: those losses' shapes (TRL's defaults).
    ``mask_truncated_completions``: completions that end without EOS get no loss weight.
    ``top_entropy_quantile`` (1: off): only the completion tokens whose entropy is in this
    top fraction of the (micro-)batch's contribute. ``scale_rewards``: ``"group"``,
    ``"batch"`` or ``"none"``. ``reward_weights``: one per reward function (None: all 1).
    ``eos_token_id`` (None: the tokenizer's ``eos_id``) ends completions.
    ``gradient_accumulation_steps``: each update runs the rollouts' rows in this many
    micro-batches (it must divide prompts * ``num_generations``), each loss type combining
    them as TRL does (``edl.train.grpo_losses.GRPOLoss.accumulate``).
    ``dynamic_sampling``: DAPO's: groups whose rewards do not vary are replaced by groups of
    further prompts (``make_grpo_step(prompt_source=...)``), at most
    ``max_dynamic_sampling_rounds`` extra rollouts per step (``edl.train.grpo_dynamic``).
    ``max_turns``: with ``make_grpo_step(environment=...)``, model turns per conversation
    (each of at most ``max_new_tokens``; ``edl.train.grpo_tools``).
    ``rollout_backend``: a name in ``edl.train.rollout_backends.ROLLOUT_BACKENDS``:
    ``"generate"`` (``edl.generate``'s decode loop; the default: faster for short prompts,
    16.1k vs 6.5k tokens/s on a tiny model in ``benchmarks/RESULTS.md``, "grpo_rollouts")
    or ``"engine"`` (the serving engine, each prompt's pages shared by its samples: 2.8x
    faster with 256-token prompts on a 4-layer width-256 model); single-turn rollouts only.
    """

    num_generations: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    scale_rewards: Literal["group", "batch", "none"] = "group"
    reward_weights: tuple[float, ...] | None = None
    eos_token_id: int | None = None
    gradient_accumulation_steps: int = 1
    dynamic_sampling: bool = False
    max_dynamic_sampling_rounds: int = 4
    max_turns: int = 1
    rollout_backend: str = "generate"

    def __post_init__(self) -> None:
        checks = {  # name: (holds, what it must be)
            "num_generations": (self.num_generations >= 2, ">= 2"),
            "max_new_tokens": (self.max_new_tokens >= 1, ">= 1"),
            "num_iterations": (self.num_iterations >= 1, ">= 1"),
            "temperature": (self.temperature > 0, "> 0"),
            "beta": (self.beta >= 0, ">= 0"),
            "epsilon": (0 <= self.epsilon < 1, "in [0, 1)"),
            "epsilon_high": (self.epsilon_high is None or self.epsilon_high >= 0, ">= 0 or None"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "loss_type": (self.loss_type in GRPO_LOSSES, f"one of {', '.join(GRPO_LOSSES)}"),
            "scale_rewards": (self.scale_rewards in SCALE_REWARDS, f"one of {SCALE_REWARDS}"),
            "importance_sampling_level": (
                self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
                f"one of {IMPORTANCE_SAMPLING_LEVELS}",
            ),
            "delta": (self.delta is None or self.delta > 0, "> 0 or None"),
            "sapo_temperature_pos": (self.sapo_temperature_pos > 0, "> 0"),
            "sapo_temperature_neg": (self.sapo_temperature_neg > 0, "> 0"),
            "top_entropy_quantile": (0 < self.top_entropy_quantile <= 1, "in (0, 1]"),
            "gradient_accumulation_steps": (self.gradient_accumulation_steps >= 1, ">= 1"),
            "max_dynamic_sampling_rounds": (self.max_dynamic_sampling_rounds >= 0, ">= 0"),
            "max_turns": (self.max_turns >= 1, ">= 1"),
            "rollout_backend": (
                self.rollout_backend in ROLLOUT_BACKENDS,
                f"one of {', '.join(ROLLOUT_BACKENDS)}",
            ),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(
                    f"GRPOConfig.{name} must be {allowed}, got {getattr(self, name)!r}"
                )


def _record(prompt: Prompt, index: int) -> Mapping[str, Any]:
    """``prompt`` as a record ``{"prompt": text or messages, ...columns}``."""
    record = prompt if isinstance(prompt, Mapping) else {"prompt": prompt}
    text = record.get("prompt")
    if isinstance(text, tuple):
        text = list(text)
    checked = validate_prompt(text, f"GRPO step: prompts[{index}]")
    return record if checked is record["prompt"] else {**record, "prompt": checked}


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = True
    return ids, mask


def _reference_model(model: CausalLM, reference: str | CausalLM) -> CausalLM:
    if isinstance(reference, str):
        return edl_lora.unwrap_lora(model)  # "lora_base": the adapters' frozen base
    return reference


@eqx.filter_jit
def _score(
    model: CausalLM,
    reference: Any,
    input_ids: Int[Array, "rows total"],
    attention_mask: Bool[Array, "rows total"],
    *,
    num_new: int,
    temperature: float,
    old: bool,
) -> tuple[Float[Array, "rows new"] | None, Float[Array, "rows new"] | None]:
    """Old-policy and reference log-probs of the completions (either may be skipped)."""
    logps = lambda m: jax.lax.stop_gradient(
        completion_logprobs(m, input_ids, attention_mask, num_new, temperature)
    )
    ref = None if reference is None else logps(_reference_model(model, reference))
    return (logps(model) if old else None), ref


def _loss_fn(config: GRPOConfig) -> Callable[[Any, Mapping[str, Array]], Any]:
    def loss_fn(model: CausalLM, batch: Mapping[str, Array]) -> tuple[Array, dict[str, Array]]:
        num_new = batch["completion_mask"].shape[1]
        entropies = None
        logps = completion_logprobs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            num_new,
            config.temperature,
            with_entropy=config.top_entropy_quantile < 1.0,
        )
        if config.top_entropy_quantile < 1.0:
            logps, entropies = logps
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        return grpo_loss(
            logps,
            old,
            batch["advantages"],
            batch["completion_mask"],
            ref_logps=batch.get("ref_logps"),
            beta=config.beta,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            loss_type=config.loss_type,
            max_new_tokens=config.max_new_tokens,
            importance_sampling_level=config.importance_sampling_level,
            delta=config.delta,
            sapo_temperature_pos=config.sapo_temperature_pos,
            sapo_temperature_neg=config.sapo_temperature_neg,
            vespo=(
                config.vespo_k_pos,
                config.vespo_lambda_pos,
                config.vespo_k_neg,
                config.vespo_lambda_neg,
            ),
            entropies=entropies,
            top_entropy_quantile=config.top_entropy_quantile,
        )

    return loss_fn


class GRPOStep:
    """``step(state, prompts) -> (state, metrics)``: one GRPO iteration (see the module
    docstring). Built by :func:`make_grpo_step`; a host function (rollouts, Python rewards,
    then the jitted updates), which ``edl.train.train`` runs like any step.

    Metrics (host floats): the updates' mean ``loss``, ``kl``, ``clip_ratio``, ``entropy``
    (with ``top_entropy_quantile < 1``, else 0), ``grad_norm`` and their max ``nonfinite``;
    with ``dynamic_sampling``, ``dynamic_sampling/rounds`` / ``kept_groups`` /
    ``filled_groups``; ``reward_mean`` / ``reward_std`` (the weighted sum),
    ``reward/<fn name>`` (each function's mean), ``completion_length`` (mean tokens, EOS
    included), ``count`` (completion tokens), ``sample_s`` (generation), ``reward_s``
    (decoding and reward functions) and ``train_s`` (scoring and updates): host wall
    seconds, each ended by ``block_until_ready``.
    """

    def __init__(
        self, update, tokenizer, reward_fns, weights, config, key, reference, prompt_source=None
    ):
        self.update, self.tokenizer, self.config = update, tokenizer, config
        self.prompt_source = prompt_source  # further prompts for dynamic sampling
        self.environment = None  # a factory of environments: multi-turn rollouts (grpo_tools)
        self.reward_fns, self.weights, self.key, self.reference = (
            reward_fns,
            weights,
            key,
            reference,
        )
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_id
        if eos is None:
            raise ValueError(
                "make_grpo_step: the tokenizer has no eos_id; set GRPOConfig.eos_token_id"
            )
        self.eos_id = int(eos)
        pad = getattr(tokenizer, "pad_id", None)
        self.pad_id = self.eos_id if pad is None else int(pad)
        self.last_rollout: dict[str, Any] | None = None  # for inspection: texts, rewards

    def rollout(
        self, model: CausalLM, prompts: Sequence[Prompt], key: PRNGKeyArray
    ) -> tuple[dict[str, Array], dict[str, float]]:
        """Sample, decode and reward ``num_generations`` completions per prompt with
        ``model``; returns the update's batch and the rollout's metrics."""
        c, g = self.config, self.config.num_generations
        if isinstance(prompts, str) or not prompts:
            raise ValueError(
                f"GRPO step: prompts must be a non-empty list of prompts, got {prompts!r:.80}"
            )
        records = [_record(p, i) for i, p in enumerate(prompts)]
        fields = [sorted(r) for r in records]
        if any(f != fields[0] for f in fields):
            raise ValueError(
                f"GRPO step: the prompt records' fields differ: {fields[0]} vs "
                f"{next(f for f in fields if f != fields[0])}"
            )
        if self.environment is not None:
            return tool_rollout(self, model, records, key)
        prompts = [r["prompt"] for r in records]
        encoded = [self._encode(p) for p in prompts]
        rows = [ids for ids in encoded for _ in range(g)]
        ids, mask = _left_pad(rows, self.pad_id)
        t0 = time.perf_counter()
        new, num_new = ROLLOUT_BACKENDS[c.rollout_backend].sample(
            model,
            encoded,
            g,
            key,
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            padded=(ids, mask),
        )
        new = jax.block_until_ready(new)
        t1 = time.perf_counter()
        new_np = np.asarray(new)
        completion_ids = [new_np[i, : num_new[i]].tolist() for i in range(len(rows))]
        texts = [self.tokenizer.decode([t for t in r if t != self.eos_id]) for r in completion_ids]
        row_prompts = [p for p in prompts for _ in range(g)]
        columns = {
            k: [r[k] for r in records for _ in range(g)] for k in records[0] if k != "prompt"
        }
        rewards, per_fn = score_completions(
            self.reward_fns, self.weights, row_prompts, texts, completion_ids, columns
        )
        advantages = group_advantages(jnp.asarray(rewards), g, scale_rewards=c.scale_rewards)
        self.last_rollout = {"prompts": row_prompts, "completions": texts, "rewards": rewards}
        loss_mask = completion_mask(new, (self.eos_id,))
        if c.mask_truncated_completions:  # TRL: the last kept token is neither EOS nor pad
            cut = truncated_rows(new, loss_mask, (self.eos_id, self.pad_id))
            loss_mask = loss_mask * (~cut)[:, None].astype(loss_mask.dtype)
        batch = {
            "input_ids": jnp.concatenate([jnp.asarray(ids), new], axis=1),
            "attention_mask": jnp.concatenate([jnp.asarray(mask), jnp.ones(new.shape, bool)], 1),
            "completion_mask": loss_mask,
            "advantages": advantages,
            "rewards": jnp.asarray(rewards),
        }
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **per_fn,
            "completion_length": float(num_new.mean()),
            "sample_s": t1 - t0,
            "reward_s": time.perf_counter() - t1,
        }
        return batch, metrics

    def _encode(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True))

    def __call__(self, state: TrainState, prompts: Sequence[Prompt]) -> tuple[TrainState, dict]:
        c, start = self.config, int(state.step)
        model = edl_state.model(state)  # the state's own arrays: nothing is copied
        key = jax.random.fold_in(self.key, start)
        batch, metrics = self.rollout(model, prompts, key)
        if c.dynamic_sampling:
            batch, metrics = dynamic_batch(self, model, batch, metrics, key)
        del batch["rewards"]
        t0 = time.perf_counter()
        old, ref = _score(
            model,
            self.reference if c.beta > 0 else None,
            batch["input_ids"],
            batch["attention_mask"],
            num_new=batch["completion_mask"].shape[1],
            temperature=c.temperature,
            old=c.num_iterations > 1,
        )
        batch.update({k: v for k, v in (("old_logps", old), ("ref_logps", ref)) if v is not None})
        del model  # the updates donate the state's buffers
        history = []
        for _ in range(c.num_iterations):
            state, step_metrics = self.update(state, batch)
            history.append(step_metrics)
        history = jax.block_until_ready(jax.device_get(history))
        metrics["train_s"] = time.perf_counter() - t0
        for k in ("loss", "kl", "clip_ratio", "grad_norm", "entropy"):
            metrics[k] = float(np.mean([h[k] for h in history]))
        metrics["nonfinite"] = int(max(h["nonfinite"] for h in history))
        metrics["count"] = float(history[0]["count"])
        # What tokens/s counts: the batch's real tokens, run forward and backward per update;
        # the completions sampled, reported apart (sampled_tokens_per_s).
        trained = int(np.sum(np.asarray(batch["attention_mask"])))
        metrics["tokens"] = float(trained * c.num_iterations)
        metrics["sampled_tokens"] = float(np.sum(np.asarray(batch["completion_mask"])))
        return edl_state.replace(state, step=start + 1), metrics


def make_grpo_step(
    tx: optax.GradientTransformation,
    tokenizer: Tokenizer,
    reward_fns: RewardFn | Sequence[RewardFn],
    config: GRPOConfig,
    *,
    key: PRNGKeyArray,
    reference: Literal["lora_base"] | Any = "lora_base",
    clip_norm: float | None = None,
    compute_dtype: Any = None,
    donate: bool = True,
    prompt_source: Any = None,
    environment: EnvironmentFactory | None = None,
) -> GRPOStep:
    """Build the GRPO step ``step(state, prompts) -> (state, metrics)`` (see
    :class:`GRPOStep`) for ``edl.train.train`` or a plain loop.

    Args:
        tx: the optimizer (``make_optimizer``); the updates are ``make_train_step``'s.
        tokenizer: ``encode(str) -> ids``, ``decode(ids) -> str``, ``eos_id`` (unless
            ``config.eos_token_id``), ``pad_id`` (else EOS pads).
        reward_fns: one :data:`RewardFn` or several (summed with ``config.reward_weights``).
        config: :class:`GRPOConfig`.
        key: the sampling key; step ``s`` samples with ``fold_in(key, s)``.
        reference: with ``config.beta > 0``: ``"lora_base"`` (the LoRA-off base of the
            state's model) or a frozen model pytree. Ignored when ``beta == 0``.
        clip_norm, compute_dtype, donate: as ``make_train_step``.
        prompt_source: with ``config.dynamic_sampling``: where further prompts come from,
            an iterator of prompt lists: pass the same ``PromptBatches`` that
            ``edl.train.train`` reads, so checkpoints save (and resume restores) the draws.
        environment: ``() -> Environment``: multi-turn rollouts, one environment per row
            (``edl.train.grpo_tools``); ``reward_fns`` may then be ``[]``.
    """
    fns = [reward_fns] if callable(reward_fns) else list(reward_fns)
    if environment is not None and config.rollout_backend != "generate":
        raise ValueError(
            f"make_grpo_step: multi-turn rollouts (environment=) sample with edl.generate "
            f"only; GRPOConfig.rollout_backend is {config.rollout_backend!r}, use 'generate'"
        )
    check_environment(environment, tokenizer, config)
    if (not fns and environment is None) or not all(callable(f) for f in fns):
        raise TypeError(f"make_grpo_step: reward_fns must be callables, got {reward_fns!r}")
    weights = config.reward_weights or (1.0,) * len(fns)
    if len(weights) != len(fns) or not all(math.isfinite(w) for w in weights):
        raise ValueError(
            f"GRPOConfig.reward_weights: need {len(fns)} finite weights (one per "
            f"reward function), got {config.reward_weights}"
        )
    if isinstance(reference, str) and reference != "lora_base":
        raise ValueError(
            f"make_grpo_step: reference must be 'lora_base' or a model, got {reference!r}"
        )
    if config.dynamic_sampling and prompt_source is None:
        raise ValueError(
            "make_grpo_step: GRPOConfig.dynamic_sampling needs prompt_source (the run's "
            "PromptBatches), where further prompts come from"
        )
    update = make_train_step(
        _loss_fn(config),
        tx,
        grad_accum_steps=config.gradient_accumulation_steps,
        clip_norm=clip_norm,
        compute_dtype=compute_dtype,
        donate=donate,
    )
    step = GRPOStep(update, tokenizer, fns, tuple(weights), config, key, reference, prompt_source)
    step.environment = environment
    return step


class PromptBatches(EpochCursor):
    """GRPO's input: ``batch_size`` prompts per step (:data:`Prompt` items: text, chat
    messages or records) from ``prompts``, in a seeded order per epoch, repeated, split over
    processes (each gets its contiguous share of the same global batch), and resumable
    exactly by ``edl.train.train`` (``position`` / ``restore``, as ``TokenBatches``)."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        repeat: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        super().__init__(
            prompts,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            repeat=repeat,
            process_index=process_index,
            process_count=process_count,
        )
        for i, prompt in enumerate(prompts):
            _record(prompt, i)  # every prompt checked before the run starts

    def current(self) -> Prompt | None:
        """The prompt at the cursor; None when ``repeat=False`` and epoch 0 is done."""
        if not self.repeat and self.epoch >= 1:
            return None
        return self.documents[self._doc_id(self.epoch, self.index)]

    def next_batch(self) -> list[Prompt] | None:
        """This process's share of the next global batch of prompts (None when done)."""
        _, mine = self.global_batch()
        return mine or None
