"""``edl train --method dpo|reward|grpo|kto``: post-training a Hugging Face causal LM (full,
LoRA or QLoRA, as ``--method sft``) with a preference loss, as a reward model, by GRPO or by
KTO.

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
  iterations of ``--num-iterations`` updates each.
- ``kto``: ``--data`` holds unpaired preference records (``prompt`` / ``completion``, strings
  or chat messages, and a boolean ``label``: desirable or not), tokenized as TRL does
  (``edl.train.kto_data.encode_unpaired``) and batched with KTO's mismatched KL pairs by
  ``edl.train.kto_data.KTOBatches``; ``edl.train.kto.make_kto_step`` against the
  ``--reference``, ``--desirable-weight`` / ``--undesirable-weight``.
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
from edl.train.grpo_rewards import RewardFn
from edl.train.kto import make_kto_step
from edl.train.kto_data import KTOBatches, encode_unpaired
from edl.train.preference import PREFERENCE_LOSSES

__all__ = ["run_post_training"]

_REPORTED = {
    "dpo": ("rewards/margins", "rewards/accuracies"),
    "reward": ("accuracy", "rewards/margins"),
    "grpo": ("reward_mean", "completion_length", "kl"),
    "kto": ("rewards/margins", "kl"),
}


def reward_functions(spec: str) -> list[Any]:
    """The callables ``spec`` names (``module:function[,module:function...]``), imported
    with the working directory on the path. ``CommandError`` names what cannot be found."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    out = []
    for name in (n.strip() for n in spec.split(",")):
        module, _, function = name.partition(":")
        if not module or not function:
            raise CommandError(f"--reward {name!r}: expected module:function")
        try:
            fn = getattr(importlib.import_module(module), function)
        except ImportError as e:
            raise CommandError(f"--reward {name}: cannot import {module!r}: {e}") from None
        except AttributeError:
            raise CommandError(f"--reward {name}: {module!r} has no {function!r}") from None
        if not callable(fn):
            raise CommandError(f"--reward {name}: {type(fn).__name__} is not callable")
        out.append(fn)
    return out


def _preference_batches(config: TrainConfig, tokenizer: HFTokenizer) -> PreferenceBatches:
    try:
        pairs = load_tokenized(source_of(config.data), tokenizer, format="preference")
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{config.data}: {e}") from None
    if len(pairs) == 0:
        raise CommandError(f"{config.data}: no records")
    return PreferenceBatches(
        pairs,
        batch_size=config.batch_size,
        max_length=config.seq_len,
        pad_id=tokenizer.pad_id,
        seed=config.seed,
    )


def _kto_batches(config: TrainConfig, tokenizer: HFTokenizer) -> KTOBatches:
    """``--data``'s unpaired records, tokenized in memory; errors name the file and line."""
    try:
        examples = [
            encode_unpaired(tokenizer, record, where=where)
            for where, record in source_of(config.data).records()
        ]
        if not examples:
            raise CommandError(f"{config.data}: no records")
        return KTOBatches(
            examples,
            batch_size=config.batch_size,
            max_length=config.seq_len,
            pad_id=tokenizer.pad_id,
            seed=config.seed,
        )
    except (OSError, ValueError, ImportError) as e:
        raise CommandError(f"{config.data}: {e}") from None


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


def _step(
    config: TrainConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    tokenizer: HFTokenizer,
    reward_fns: list[RewardFn],
    prompts: PromptBatches | None = None,
) -> Any:
    options = {**step_options(config), "schedule": schedule}
    if config.method == "reward":
        return make_reward_step(tx, **options)
    reference = config.reference_kind
    uses_reference = (
        (config.method == "dpo" and PREFERENCE_LOSSES[config.method_loss_type].needs_reference)
        or (config.method == "grpo" and config.beta > 0)
        or config.method == "kto"
    )
    frozen = _reference_model(config) if reference == "model" and uses_reference else None
    if config.method == "kto":
        return make_kto_step(
            tx,
            beta=config.beta or 0.1,
            desirable_weight=config.desirable_weight,
            undesirable_weight=config.undesirable_weight,
            reference=reference,
            reference_model=frozen,
            **options,
        )
    if config.method == "dpo":
        return make_dpo_step(
            tx,
            loss_type=config.method_loss_type,
            beta=config.beta or None,
            reference=reference,
            reference_model=frozen,
            **options,
        )
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
    )
    return make_grpo_step(
        tx,
        tokenizer,
        reward_fns,
        grpo,
        key=jax.random.key(config.seed),
        reference="lora_base" if frozen is None else frozen,
        clip_norm=options["clip_norm"],
        compute_dtype=options["compute_dtype"],
        prompt_source=prompts,
    )


def _reported(config: TrainConfig) -> dict[str, Any]:
    """The method's metrics at the first and last step, from the run's ``metrics.jsonl``."""
    lines = (Path(config.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    history = [m for m in map(json.loads, lines) if "loss" in m]
    out = {}
    for name in _REPORTED[config.method]:
        values = [m[name] for m in history if name in m]
        if values:
            out[f"first_{name}"], out[f"final_{name}"] = values[0], values[-1]
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
        data = HostCheckedBatches(_kto_batches(config, tokenizer), model.config.vocab_size)
    else:
        data = HostCheckedBatches(_preference_batches(config, tokenizer), model.config.vocab_size)
    updates = config.run.steps * (config.num_iterations if config.method == "grpo" else 1)
    tx, schedule = optimizer(config, updates=updates)
    prompts = data if config.method == "grpo" else None  # dynamic sampling's further prompts
    step = _step(config, tx, schedule, tokenizer, reward_fns, prompts)
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
        None,
        trainable=trainable,
        tokenizer=tokenizer,
        step=step,
        tx=tx,
        base=base,
    )
    out = {
        k: summary.get(k)
        for k in ("start_step", "end_step", "stop_reason", "first_loss", "final_loss")
    }
    out.update(_reported(config))
    out["seconds"] = round(summary["seconds"], 1)
    print(json.dumps(out))
    return summary
