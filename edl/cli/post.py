"""``edl train --method dpo|reward|grpo|kto|distill``: post-training a Hugging Face causal LM
(full, LoRA or QLoRA, as ``--method sft``) with a preference loss, as a reward model, by GRPO,
by KTO or by distillation from a teacher.

- ``dpo``: ``--data`` holds preference records (``prompt`` / ``chosen`` / ``rejected``,
  strings or chat messages), tokenized as TRL does (``edl.text.load_tokenized``) and batched
  by ``edl.train.PreferenceBatches``; ``--loss-type`` picks a loss of
  ``edl.train.preference.PREFERENCE_LOSSES``: DPO / IPO / hinge (against the ``--reference``),
  the reference-free SimPO / ORPO, or a registered one (``edl.train.make_dpo_step``).
- ``reward``: the same records train a reward model: the model's backbone with a new
  one-output ``score`` head (trained along with LoRA adapters), Bradley-Terry loss
  (``edl.train.make_reward_step``); checkpoints are ``*ForSequenceClassification``.
- ``grpo``: ``--data`` holds prompt records (``prompt``: text or chat messages, other fields
  passed to the reward functions), ``--reward module:function`` scores completions sampled
  from the model being trained (``edl.train.make_grpo_step``); ``--steps`` counts GRPO
  iterations of ``--num-iterations`` updates each. ``--environment module:function`` (a
  factory of ``edl.train.Environment``, e.g. a ``ToolEnvironment`` of Python tools) makes
  the rollouts conversations of up to ``--max-turns`` turns (``edl.train.grpo_tools``).
- ``kto``: ``--data`` holds unpaired preference records (``prompt`` / ``completion``, strings
  or chat messages, and a boolean ``label``: desirable or not), tokenized as TRL does
  (``edl.train.kto_data.encode_unpaired``) and batched with KTO's mismatched KL pairs by
  ``edl.train.kto_data.KTOBatches``; ``edl.train.kto.make_kto_step`` against the
  ``--reference``, ``--desirable-weight`` / ``--undesirable-weight``.
- ``distill``: ``--data`` holds TRL's GKD records (``messages``, or ``prompt`` /
  ``completion``), tokenized as TRL does (``edl.train.distill_data.encode_distill``) and
  batched by ``edl.train.distill_data.DistillBatches``; ``--teacher`` (any width and depth,
  ``--model``'s vocabulary) is loaded frozen in ``--param-dtype`` and
  ``edl.train.distill.make_distill_step`` trains the student on the generalised JSD
  (``--beta``, ``--temperature``), on its own samples with probability ``--lmbda`` and on
  the teacher's with ``--seq-kd`` (``--max-new-tokens`` each).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import edl
from edl.cli.config import CommandError, TrainConfig
from edl.cli.data import source_of
from edl.cli.finetune import load_for_finetuning, model_directory
from edl.cli.run import (
    HostCheckedBatches,
    check_output_dir,
    optimizer,
    step_options,
    train_model,
)
from edl.io.export import load_model
from edl.lora import lora_trainable
from edl.models import configure, registry
from edl.nn import Linear
from edl.text import load_tokenized
from edl.text.hf import HFTokenizer
from edl.text.sources import validate_prompt
from edl.train import (
    GRPOConfig,
    PreferenceBatches,
    PromptBatches,
    make_dpo_step,
    make_grpo_step,
    make_reward_step,
)
from edl.train.distill import make_distill_step
from edl.train.distill_data import DistillBatches, encode_distill
from edl.train.environments import check_factory
from edl.train.grpo_rewards import RewardFn
from edl.train.kto import make_kto_step
from edl.train.kto_data import KTOBatches, encode_unpaired
from edl.train.post_eval import make_dpo_eval_step, make_kto_eval_step, make_reward_eval_step
from edl.train.preference import PREFERENCE_LOSSES

__all__ = ["run_post_training"]

_REPORTED = {
    "dpo": ("rewards/margins", "rewards/accuracies"),
    "reward": ("accuracy", "rewards/margins"),
    "grpo": ("reward_mean", "completion_length", "kl"),
    "kto": ("rewards/margins", "kl"),
    "distill": ("on_policy",),
}


def reward_functions(spec: str, flag: str = "--reward") -> list[Any]:
    """The callables ``spec`` names (``module:function[,module:function...]``; empty:
    none), imported with the working directory on the path. ``CommandError`` names
    ``flag`` and what cannot be found."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    out = []
    for name in (n.strip() for n in spec.split(",") if spec):
        module, _, function = name.partition(":")
        if not module or not function:
            raise CommandError(f"{flag} {name!r}: expected module:function")
        try:
            fn = getattr(importlib.import_module(module), function)
        except ImportError as e:
            raise CommandError(f"{flag} {name}: cannot import {module!r}: {e}") from None
        except AttributeError:
            raise CommandError(f"{flag} {name}: {module!r} has no {function!r}") from None
        if not callable(fn):
            raise CommandError(f"{flag} {name}: {type(fn).__name__} is not callable")
        out.append(fn)
    return out


def environment_factory(config: TrainConfig) -> Any:
    """``--environment``'s factory (None without one), imported as ``--reward``'s functions."""
    if not config.environment:
        return None
    if "," in config.environment:
        raise CommandError(f"--environment {config.environment!r}: expected one module:function")
    factory = reward_functions(config.environment, "--environment")[0]
    try:  # one environment built now: a factory of the wrong kind fails before the model
        check_factory(factory)
    except TypeError as e:
        raise CommandError(f"--environment {config.environment}: {e}") from e
    return factory


def _preference_batches(
    config: TrainConfig, tokenizer: HFTokenizer, spec: str, *, held_out: bool = False
) -> PreferenceBatches:
    """``spec``'s preference records (``--data`` or ``--eval-data``), tokenized; held-out
    data is read once, in order."""
    try:
        pairs = load_tokenized(source_of(spec), tokenizer, format="preference")
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{spec}: {e}") from None
    if len(pairs) == 0:
        raise CommandError(f"{spec}: no records")
    return PreferenceBatches(
        pairs,
        batch_size=config.batch_size,
        max_length=config.seq_len,
        pad_id=tokenizer.pad_id,
        seed=config.seed,
        shuffle=not held_out,
        repeat=not held_out,
    )


def _kto_batches(
    config: TrainConfig, tokenizer: HFTokenizer, spec: str, *, held_out: bool = False
) -> KTOBatches:
    """``spec``'s unpaired records, tokenized in memory; errors name the file and line."""
    try:
        examples = [
            encode_unpaired(tokenizer, record, where=where)
            for where, record in source_of(spec).records()
        ]
        if not examples:
            raise CommandError(f"{spec}: no records")
        return KTOBatches(
            examples,
            batch_size=config.batch_size,
            max_length=config.seq_len,
            pad_id=tokenizer.pad_id,
            seed=config.seed,
            shuffle=not held_out,
            repeat=not held_out,
        )
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{spec}: {e}") from None


def _held_out(config: TrainConfig, tokenizer: HFTokenizer, vocab_size: int) -> list[Any]:
    """``--eval-data``'s batches for ``dpo`` / ``reward`` / ``kto``, one pass in file order,
    ids checked on the host; the last batch cut to its real rows (the cursor pads it with
    all-padding ones, which would count in the metrics' means)."""
    if config.method == "kto":
        cursor: Any = _kto_batches(config, tokenizer, config.eval_data, held_out=True)
        key = "attention_mask"
    else:
        cursor = _preference_batches(config, tokenizer, config.eval_data, held_out=True)
        key = "chosen_attention_mask"
    out = []
    for batch in HostCheckedBatches(cursor, vocab_size):
        rows = int(np.count_nonzero(np.asarray(batch[key]).sum(axis=1)))
        if rows:
            out.append({k: v[:rows] for k, v in batch.items()})
    if not out:
        raise CommandError(f"--eval-data {config.eval_data}: no records left after cutting")
    return out


def _distill_batches(config: TrainConfig, tokenizer: HFTokenizer) -> DistillBatches:
    """``--data``'s distillation records, tokenized in memory; errors name the file and
    line."""
    try:
        examples = [
            encode_distill(tokenizer, record, where=where)
            for where, record in source_of(config.data).records()
        ]
        if not examples:
            raise CommandError(f"{config.data}: no records")
        return DistillBatches(
            examples,
            batch_size=config.batch_size,
            max_length=config.seq_len,
            pad_id=tokenizer.pad_id,
            seed=config.seed,
        )
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{config.data}: {e}") from None


def _distill_step(
    config: TrainConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    tokenizer: HFTokenizer,
    student: eqx.Module,
) -> Any:
    """``make_distill_step`` against ``--teacher``, loaded frozen in the trained weights'
    dtype without the in-program id check (batches are checked on the host)."""
    teacher = load_model(model_directory(config.teacher), dtype=config.param_dtype)
    teacher = configure(teacher, check_inputs=False)
    try:
        return make_distill_step(
            tx,
            teacher,
            beta=config.beta,
            temperature=config.temperature,
            lmbda=config.lmbda,
            seq_kd=config.seq_kd,
            max_new_tokens=config.max_new_tokens,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
            key=jax.random.key(config.seed),
            student=student,
            **step_options(config),
            schedule=schedule,
        )
    except ValueError as e:
        raise CommandError(f"--teacher {config.teacher}: {e}") from None


def _prompt_batches(config: TrainConfig) -> PromptBatches:
    try:
        records = [(where, r) for where, r in source_of(config.data).records()]
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{config.data}: {e}") from None
    bad = next((where for where, r in records if "prompt" not in r), None)
    if bad is not None:
        raise CommandError(f"{bad}: --method grpo reads records with a 'prompt' field")
    try:  # checked here too, so that errors name the file and line
        records = [
            (where, {**r, "prompt": validate_prompt(r["prompt"], where)}) for where, r in records
        ]
    except ValueError as e:
        raise CommandError(str(e)) from None
    if not records:
        raise CommandError(f"{config.data}: no records")
    try:
        return PromptBatches(
            [r for _, r in records], batch_size=config.batch_size, seed=config.seed
        )
    except ValueError as e:
        raise CommandError(f"{config.data}: {e}") from None


def _reward_model(
    model: eqx.Module, tokenizer: HFTokenizer, trainable: Any, config: TrainConfig
) -> tuple[eqx.Module, Any]:
    """The causal LM's backbone under a new one-output ``score`` head (HF's initialisation),
    pooling at the last non-pad token; the head is trained along with any LoRA adapters."""
    family, _ = registry.family_of(model)
    cls = family.tasks["sequence_classification"]
    hf_config = model.config.replace(num_labels=1, pad_token_id=tokenizer.pad_id)
    backbone = dataclasses.replace(model.model, config=hf_config)
    score = Linear.init(
        hf_config.hidden_size,
        1,
        std=hf_config.initializer_range,
        dtype=config.param_dtype,
        key=jax.random.fold_in(jax.random.key(config.seed), 1),
    )
    if trainable is not None:
        trainable = re.compile(f"{lora_trainable.pattern}|^score\\.")
    return cls(backbone, score), trainable


def _reference_model(config: TrainConfig) -> eqx.Module:
    """A frozen copy of ``--model`` (``--reference model``), in the trained weights' dtype,
    without the in-program id check (the batches are checked on the host: see
    ``edl.cli.run.HostCheckedBatches``)."""
    frozen = load_model(model_directory(config.model), dtype=config.param_dtype)
    return configure(frozen, check_inputs=False)


def _steps(
    config: TrainConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    tokenizer: HFTokenizer,
    reward_fns: list[RewardFn],
    prompts: PromptBatches | None = None,
) -> tuple[Any, Any]:
    """The method's train step and, with ``--eval-data``, its eval step (else None), which
    share one frozen ``--reference model``; ``prompts``: GRPO's data, from which dynamic
    sampling draws further prompts."""
    options = {**step_options(config), "schedule": schedule}
    evaluates = bool(config.eval_data)
    if config.method == "reward":
        return make_reward_step(tx, **options), make_reward_eval_step() if evaluates else None
    reference = config.reference_kind
    uses_reference = (
        (config.method == "dpo" and PREFERENCE_LOSSES[config.method_loss_type].needs_reference)
        or (config.method == "grpo" and config.beta > 0)
        or config.method == "kto"
    )
    frozen = _reference_model(config) if reference == "model" and uses_reference else None
    if config.method in ("kto", "dpo"):
        loss = (
            {
                "beta": config.beta or 0.1,
                "desirable_weight": config.desirable_weight,
                "undesirable_weight": config.undesirable_weight,
            }
            if config.method == "kto"
            else {"loss_type": config.method_loss_type, "beta": config.beta or None}
        )
        loss |= {"reference": reference, "reference_model": frozen}
        train_step, eval_step = {
            "kto": (make_kto_step, make_kto_eval_step),
            "dpo": (make_dpo_step, make_dpo_eval_step),
        }[config.method]
        return train_step(tx, **loss, **options), eval_step(**loss) if evaluates else None
    grpo = GRPOConfig(
        num_generations=config.num_generations,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        beta=config.beta,
        num_iterations=config.num_iterations,
        loss_type=config.method_loss_type,
        importance_sampling_level=config.importance_sampling_level,
        mask_truncated_completions=config.mask_truncated_completions,
        top_entropy_quantile=config.top_entropy_quantile,
        gradient_accumulation_steps=config.grad_accum_steps,
        dynamic_sampling=config.dynamic_sampling,
        max_turns=config.max_turns,
        rollout_backend=config.rollout_backend,
    )
    step = make_grpo_step(
        tx,
        tokenizer,
        reward_fns,
        grpo,
        key=jax.random.key(config.seed),
        reference="lora_base" if frozen is None else frozen,
        clip_norm=options["clip_norm"],
        compute_dtype=options["compute_dtype"],
        prompt_source=prompts,
        environment=environment_factory(config),
    )
    return step, None


def _reported(config: TrainConfig) -> dict[str, Any]:
    """The method's metrics at the first and last step (and their held-out ``eval_*`` at
    the first and last evaluation), from the run's ``metrics.jsonl``."""
    lines = (Path(config.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    history = list(map(json.loads, lines))
    out = {}
    for name in _REPORTED[config.method]:
        for key, rows in ((name, "loss"), (f"eval_{name}", f"eval_{name}")):
            values = [m[key] for m in history if rows in m and key in m]
            if values:
                out[f"first_{key}"], out[f"final_{key}"] = values[0], values[-1]
    return out


def run_post_training(config: TrainConfig) -> dict[str, Any]:
    """Post-train ``config.model`` by ``config.method`` on ``config.data``; print one JSON
    line of results; return the loop's summary."""
    check_output_dir(config)
    model, tokenizer, trainable, base = load_for_finetuning(config)
    if config.method == "reward":  # a new head beside the adapters: no adapter-only form
        model, trainable = _reward_model(model, tokenizer, trainable, config)
        base = None
    # Token ids are checked on the host, not in the compiled steps, so that jax can keep the
    # steps in its persistent compilation cache (edl.cli.run.HostCheckedBatches). GRPO's
    # prompts are checked by edl.generate before sampling; sampled ids lie in the vocabulary.
    model = configure(model, check_inputs=False)
    reward_fns = []
    if config.method == "grpo":
        data: Any = _prompt_batches(config)
        reward_fns = reward_functions(config.reward)  # a wrong name fails before any work
    elif config.method == "kto":
        data = HostCheckedBatches(
            _kto_batches(config, tokenizer, config.data), model.config.vocab_size
        )
    elif config.method == "distill":
        data = HostCheckedBatches(_distill_batches(config, tokenizer), model.config.vocab_size)
    else:
        data = HostCheckedBatches(
            _preference_batches(config, tokenizer, config.data), model.config.vocab_size
        )
    held_out = _held_out(config, tokenizer, model.config.vocab_size) if config.eval_data else None
    updates = config.run.steps * (config.num_iterations if config.method == "grpo" else 1)
    tx, schedule = optimizer(config, updates=updates)
    if config.method == "distill":
        step, eval_step = _distill_step(config, tx, schedule, tokenizer, model), None
    else:
        prompts = data if config.method == "grpo" else None  # dynamic sampling's prompts
        step, eval_step = _steps(config, tx, schedule, tokenizer, reward_fns, prompts)
    trained = edl.count_params(edl.split(model, trainable)[0] if trainable else model)
    print(
        f"edl train --method {config.method}: {config.model}: {edl.count_params(model):,} "
        f"parameters ({trained:,} trained), {len(data.documents)} records, {config.run.steps} "
        f"steps, output in {config.run.output_dir}",
        file=sys.stderr,
    )
    _, summary = train_model(
        config,
        model,
        data,
        held_out,
        trainable=trainable,
        tokenizer=tokenizer,
        step=step,
        tx=tx,
        base=base,
        eval_step=eval_step,
    )
    out = {
        k: summary.get(k)
        for k in ("start_step", "end_step", "stop_reason", "first_loss", "final_loss")
    }
    out.update(_reported(config))
    out["seconds"] = round(summary["seconds"], 1)
    print(json.dumps(out))
    return summary
