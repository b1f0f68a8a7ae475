"""The ``edl`` command: ``edl train``, ``edl generate``, ``edl info``.

``edl train`` with no arguments trains a small Llama on the embedded corpus (the Python
standard library's own sources, byte-level) for a few minutes on a CPU, then prints a sample.
Every option is a flag, or a key of a TOML file given with ``--config`` (flags win).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["TrainConfig", "main", "sample"]


@dataclasses.dataclass
class TrainConfig:
    """Defaults of ``edl train``: 0.8M parameters, 2000 steps or four minutes (whichever
    comes first) on a 2-core CPU."""

    output_dir: str = "runs/edl-train"
    steps: int = 2000
    time_limit: float = 240.0
    batch_size: int = 8
    seq_len: int = 128
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    optimizer: str = "adamw"
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    grad_accum_steps: int = 1
    seed: int = 0
    corpus_bytes: int = 4_000_000
    eval_every: int = 200
    eval_batches: int = 4
    save_every: int = 250
    keep: int = 3
    resume: bool = False
    prompt: str = "def "
    sample_tokens: int = 200
    sample_temperature: float = 0.7
    peak_flops: float = 1e11  # for MFU; a rough figure for this class of CPU


def sample(model, prompt_ids, max_new_tokens: int, *, key=None, temperature: float = 0.0):
    """Extend ``prompt_ids`` (a list of ints) by ``max_new_tokens`` tokens, greedily
    (``temperature=0``) or by plain temperature sampling, with ``edl.generate`` (KV cache,
    one compiled decode loop)."""
    import jax
    import jax.numpy as jnp

    from edl.generate import generate

    sampling = {"do_sample": True, "temperature": temperature, "top_k": None}
    out = generate(
        model, jnp.asarray([prompt_ids], jnp.int32), max_new_tokens=max_new_tokens,
        key=jax.random.key(0) if key is None else key, **(sampling if temperature > 0 else {}),
    )  # fmt: skip
    return [int(t) for t in out.sequences[0]]


def _train(config: TrainConfig) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import edl
    from edl.models import LlamaConfig, LlamaForCausalLM, flops_per_token
    from edl.train import ByteTokenizer, TokenBatches, load_corpus, split_corpus
    from edl.train.loop import train
    from edl.train.step import OptimizerConfig, make_eval_step, make_optimizer, make_train_step

    tokenizer = ByteTokenizer()
    train_docs, eval_docs = split_corpus(load_corpus(max_bytes=config.corpus_bytes))
    data = TokenBatches(train_docs, batch_size=config.batch_size, max_length=config.seq_len,
                        tokenizer=tokenizer, seed=config.seed)  # fmt: skip
    eval_data = TokenBatches(eval_docs, batch_size=config.batch_size, max_length=config.seq_len,
                             tokenizer=tokenizer, shuffle=False, repeat=False)  # fmt: skip
    eval_batches = [next(eval_data) for _ in range(config.eval_batches)]
    model_config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=max(2048, config.seq_len), pad_token_id=tokenizer.pad_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM.init(model_config, key=jax.random.key(config.seed))
    opt = OptimizerConfig(name=config.optimizer, learning_rate=config.learning_rate,
                          warmup_steps=min(config.warmup_steps, config.steps),
                          total_steps=config.steps, weight_decay=config.weight_decay)  # fmt: skip
    tx, schedule = make_optimizer(opt)

    def loss_fn(model, batch):
        return model.compute_loss(
            jnp.asarray(batch["input_ids"]), labels=jnp.asarray(batch["labels"]),
            segment_ids=jnp.asarray(batch["segment_ids"]),
            position_ids=jnp.asarray(batch["position_ids"]),
        )  # fmt: skip

    step = make_train_step(loss_fn, tx, grad_accum_steps=config.grad_accum_steps,
                           clip_norm=config.clip_norm, schedule=schedule)  # fmt: skip
    state = edl.create_state(model, tx)
    print(f"edl train: {edl.count_params(model):,} parameters, {len(train_docs)} documents, "
          f"output in {config.output_dir}", file=sys.stderr)  # fmt: skip
    state, summary = train(
        state, step, data, steps=config.steps, eval_step=make_eval_step(loss_fn),
        eval_data=eval_batches, eval_every=config.eval_every, eval_batches=config.eval_batches,
        save_every=config.save_every, output_dir=config.output_dir, resume=config.resume,
        time_limit=config.time_limit, flops_per_token=flops_per_token(model_config, config.seq_len),
        peak_flops=config.peak_flops, keep=config.keep, config=dataclasses.asdict(config),
    )  # fmt: skip
    for key in ("first_loss", "final_loss"):
        if summary.get(key) is not None:
            summary[key.replace("loss", "bits_per_byte")] = summary[key] / math.log(2)
    if "eval_loss" in summary.get("final_eval", {}):  # held out, over eval_batches batches:
        # steadier than the last training batch's loss (final_bits_per_byte)
        summary["eval_bits_per_byte"] = summary["final_eval"]["eval_loss"] / math.log(2)
    prompt = tokenizer.encode(config.prompt)
    text = tokenizer.decode(sample(edl.state.model(state), prompt, config.sample_tokens,
                                   key=jax.random.key(config.seed),
                                   temperature=config.sample_temperature))  # fmt: skip
    print(json.dumps({k: summary[k] for k in ("start_step", "end_step", "stop_reason",
                      "first_bits_per_byte", "final_bits_per_byte", "eval_bits_per_byte",
                      "final_eval_step") if k in summary}))  # fmt: skip
    print(f"--- sample (temperature {config.sample_temperature}, prompt {config.prompt!r}) ---")
    print(text)
    return summary


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with TrainConfig keys")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "str": str}[field.type]
            parser.add_argument(flag, type=kind, default=None)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(tomllib.loads(args.config.read_text()))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(
            f"edl train: unknown keys {unknown} in {args.config}; known: {sorted(known)}"
        )
    values.update({k: v for k, v in vars(args).items() if k in known and v is not None})
    return TrainConfig(**values)


def _info(path: Path) -> None:
    from edl.io.checkpoint import latest_checkpoint, list_checkpoints

    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if list_checkpoints(path):
        newest = latest_checkpoint(path)
        info = json.loads((newest / "state.json").read_text())
        print(f"{path}: {len(list_checkpoints(path))} checkpoint(s); newest {newest.name}")
        print(json.dumps({k: v for k, v in info.items() if k != "metadata"}, indent=2))
        path = newest
    if (path / "config.json").is_file():
        import edl

        model = edl.from_pretrained(path)
        print(edl.summary(model))


def _generate(args: argparse.Namespace) -> None:
    import jax

    import edl
    from edl.io.checkpoint import latest_checkpoint
    from edl.train import ByteTokenizer

    path = args.model
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    path = latest_checkpoint(path) or path
    model = edl.from_pretrained(path)
    tokenizer = ByteTokenizer()
    ids = sample(model, tokenizer.encode(args.prompt), args.max_new_tokens,
                 key=jax.random.key(args.seed), temperature=args.temperature)  # fmt: skip
    print(tokenizer.decode(ids))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``edl`` console script."""
    parser = argparse.ArgumentParser(prog="edl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_flags(commands.add_parser("train", help="train a model (defaults: tiny Llama)"))
    gen = commands.add_parser("generate", help="sample from a saved model or run directory")
    gen.add_argument("--model", type=Path, required=True)
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    info = commands.add_parser("info", help="summarise a saved model, checkpoint or run")
    info.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.command == "train":
        _train(_train_config(args))
    elif args.command == "generate":
        _generate(args)
    else:
        _info(args.path)


if __name__ == "__main__":
    main()
