"""``edl train``: a byte-level Llama on the embedded corpus, built from a ``TrainConfig``."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import jax

import edl
from edl.cli.checks import check_before_work
from edl.cli.config import TrainConfig
from edl.cli.distributed import is_lead, process_split, start
from edl.cli.generate import sample
from edl.cli.run import check_output_dir, train_model
from edl.compile_cache import announce_compile
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.sharding import gather_state
from edl.train import (
    ByteTokenizer,
    Callback,
    StepInfo,
    TokenBatches,
    load_corpus,
    split_corpus,
)

__all__ = ["BitsPerByte", "run_train"]

_LN2 = math.log(2)


class BitsPerByte(Callback):
    """``bits_per_byte`` and ``eval_bits_per_byte``: a byte model's losses in bits (its
    cross entropy over ln 2), logged and shown beside the loss."""

    def metrics(self, info: StepInfo) -> dict[str, float]:
        out = {}
        for key in ("loss", "eval_loss"):
            if key in info.metrics:
                out[key.replace("loss", "bits_per_byte")] = info.metrics[key] / _LN2
        return out


def _model(config: TrainConfig, tokenizer: ByteTokenizer) -> LlamaForCausalLM:
    model_config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=max(2048, config.seq_len),
        pad_token_id=tokenizer.pad_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM.init(model_config, key=jax.random.key(config.seed))


def run_train(config: TrainConfig) -> dict[str, Any]:
    """Train as ``config`` says; print one JSON line of results and a sample; return the
    loop's summary. With ``config.model``: fine-tuning (``edl.cli.finetune``). With several
    processes every one runs this; process 0 prints."""
    start(config)
    check_before_work(config)  # one line and an exit code, before any model or data loads
    if config.method != "sft":
        from edl.cli.post import run_post_training

        return run_post_training(config)
    if config.model:
        from edl.cli.finetune import run_finetune

        return run_finetune(config)
    check_output_dir(config)
    tokenizer = ByteTokenizer()
    data, eval_batches = _byte_data(config, tokenizer)
    model = _model(config, tokenizer)
    print(
        f"edl train: {edl.count_params(model):,} parameters, {len(data.documents)} documents, "
        f"{config.run.steps} steps, output in {config.run.output_dir}",
        file=sys.stderr,
    )
    state, summary = train_model(config, model, data, eval_batches, callbacks=[BitsPerByte()])
    # Sampled on each host from the whole model (all-gathered from several processes).
    trained = edl.state.model(state if jax.process_count() == 1 else gather_state(state))
    say = _stderr if is_lead() else lambda _: None
    with announce_compile(f"the sample's decode loop ({config.sample_tokens} tokens)", say):
        ids = sample(
            trained,
            tokenizer.encode(config.prompt),
            config.sample_tokens,
            key=jax.random.key(config.seed),
            temperature=config.sample_temperature,
        )
    text = tokenizer.decode(ids)
    if is_lead():
        _report(summary)
        print(f"--- sample (temperature {config.sample_temperature}, prompt {config.prompt!r}) ---")
        print(text)
    return summary


def _stderr(message: str) -> None:
    print(f"edl train: {message}", file=sys.stderr, flush=True)


def _byte_data(
    config: TrainConfig, tokenizer: ByteTokenizer
) -> tuple[TokenBatches, list[dict[str, Any]] | None]:
    """Training batches and held-out batches: the embedded corpus split in two, or
    ``config.data`` (and ``config.eval_data``, when given) read as text."""
    if config.data:
        from edl.cli.data import batches

        held_out = (
            batches(config, config.eval_data, tokenizer, shuffle=False)
            if (config.eval_data)
            else None
        )
        data = batches(config, config.data, tokenizer, shuffle=True)
    else:
        train_docs, eval_docs = split_corpus(load_corpus(max_bytes=config.corpus_bytes))
        data = TokenBatches(
            train_docs,
            batch_size=config.batch_size,
            max_length=config.seq_len,
            tokenizer=tokenizer,
            seed=config.seed,
            **process_split(),
        )
        held_out = TokenBatches(
            eval_docs,
            batch_size=config.batch_size,
            max_length=config.seq_len,
            tokenizer=tokenizer,
            shuffle=False,
            repeat=False,
            **process_split(),
        )
    if held_out is None:
        return data, None
    return data, [b for _, b in zip(range(config.run.eval.batches), held_out, strict=False)]


def _report(summary: dict[str, Any]) -> None:
    """One JSON line: steps, why the run stopped, bits per byte of the first and last
    training batch, and the last held-out evaluation (the steady number)."""
    out = {k: summary[k] for k in ("start_step", "end_step", "stop_reason") if k in summary}
    for key in ("first_loss", "final_loss"):
        if summary.get(key) is not None:
            out[key.replace("loss", "bits_per_byte")] = summary[key] / _LN2
    if "eval_loss" in summary.get("final_eval", {}):
        out["eval_bits_per_byte"] = summary["final_eval"]["eval_loss"] / _LN2
        out["final_eval_step"] = summary["final_eval_step"]
    out["seconds"] = round(summary["seconds"], 1)
    print(json.dumps(out))
