"""``edl train --model``: full, LoRA or QLoRA fine-tuning of a Hugging Face causal LM on the
user's data, with the model's own tokenizer and chat template.

Checkpoints hold the tokenizer files beside the weights, so ``edl generate --model RUN_DIR``
and ``edl export`` read them. A full fine-tune's are HF model directories; a LoRA / QLoRA
run's hold the adapters (PEFT's layout), the optimizer state and a reference to the base
(``edl.io.formats.base_ref``: its path or hub repo id and the sha256 of its weights, hashed
once when the base is loaded), or the whole model too with ``--save-base``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import edl
from edl.cli.config import CommandError, TrainConfig
from edl.cli.data import batches
from edl.cli.distributed import is_lead
from edl.cli.info import resolve_model
from edl.cli.run import check_output_dir, check_resumed_base, train_model
from edl.io.export import load_base
from edl.io.formats.base_ref import BaseReference, reference
from edl.lora import apply_lora, lora_trainable
from edl.quantize import QuantConfig, is_quantized
from edl.text import HFTokenizer, load_tokenizer
from edl.train import TokenBatches

__all__ = ["run_finetune"]


def model_directory(source: str) -> str:
    """A local run directory or checkpoint resolves to its newest whole checkpoint; anything
    else (a model directory, a hub repo id) is passed on as given."""
    path = Path(source).expanduser()
    return str(resolve_model(path)) if path.exists() else source


def load_for_finetuning(
    config: TrainConfig,
) -> tuple[Any, HFTokenizer, Any, BaseReference | None]:
    """``(model, tokenizer, trainable, base)`` for ``config.model``: the weights in
    ``config.param_dtype``, quantized (``config.quantize``) and wrapped in LoRA adapters
    (``config.lora_rank``) as asked (``edl.io.export.load_base``: a checkpoint of an earlier
    LoRA run is continued from its merged weights); ``trainable`` is what
    ``edl.create_state`` trains (``None``: every weight); ``base`` is the reference to the
    base of a LoRA run (its weights hashed here, once), ``None`` for a full fine-tune."""
    source = model_directory(config.model)
    quantization = None
    if config.quantize != "none":
        quantization = dataclasses.asdict(QuantConfig(config.quantize))
    dtype = jnp.dtype(config.param_dtype)
    try:
        tokenizer = load_tokenizer(source)
        model = load_base(source, dtype=dtype, quantization=quantization)
        base = None
        if config.lora_rank:
            base = reference(source, dtype=dtype, quantization=quantization)
    except (OSError, ValueError) as e:
        raise CommandError(f"--model {config.model}: {e}") from None
    if not hasattr(model, "compute_loss"):
        raise CommandError(f"--model {config.model}: {type(model).__name__} is not a causal LM")
    if is_quantized(model) and not config.lora_rank:
        raise CommandError(f"--model {config.model} is quantized: train it with --lora-rank")
    if config.run.resume and config.run.output_dir is not None:
        check_resumed_base(Path(config.run.output_dir), base)
    if not config.lora_rank:
        return model, tokenizer, None, None
    model = apply_lora(
        model, rank=config.lora_rank, alpha=config.lora_alpha, key=jax.random.key(config.seed)
    )
    return model, tokenizer, lora_trainable, base


def run_finetune(config: TrainConfig) -> dict[str, Any]:
    """Fine-tune ``config.model`` on ``config.data``; print one JSON line of results and a
    sample; return the loop's summary."""
    check_output_dir(config)
    model, tokenizer, trainable, base = load_for_finetuning(config)
    data: TokenBatches = batches(config, config.data, tokenizer, shuffle=True)
    eval_batches = None
    if config.eval_data:
        held_out = batches(config, config.eval_data, tokenizer, shuffle=False)
        eval_batches = [b for _, b in zip(range(config.run.eval.batches), held_out, strict=False)]
    trained = edl.count_params(edl.split(model, trainable)[0] if trainable else model)
    print(
        f"edl train: {config.model}: {edl.count_params(model):,} parameters "
        f"({trained:,} trained), {len(data.documents)} examples, {config.run.steps} steps, "
        f"output in {config.run.output_dir}",
        file=sys.stderr,
    )
    _, summary = train_model(
        config, model, data, eval_batches, trainable=trainable, tokenizer=tokenizer, base=base
    )
    out = {
        k: summary.get(k)
        for k in ("start_step", "end_step", "stop_reason", "first_loss", "final_loss")
    }
    if "eval_loss" in summary.get("final_eval", {}):
        out["eval_loss"] = summary["final_eval"]["eval_loss"]
    out["seconds"] = round(summary["seconds"], 1)
    if is_lead():
        print(json.dumps(out))
    return summary
