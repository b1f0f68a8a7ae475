"""Disk use of a LoRA run's checkpoints: adapter-only (the default) against the full layout
(``--save-base``), and the time a save takes.

A Llama of SmolLM2-135M's shape (``--shape 135m``: 30 layers, hidden 576, MLP 1536, 9 / 3
heads, vocabulary 49152, tied embeddings; random weights, float32) is written as a Hugging
Face directory, the base; rank-8 LoRA adapters on every projection (2.44M parameters, the
issue's 2.4M) are trained by AdamW. Five checkpoints of the state (steps 1 to 5) are saved
adapter-only (``save_state(..., base=reference(base))``) and five with the base inside
(``save_state(...)``), and the directories' bytes are summed. No tokenizer files (a real run
adds the tokenizer's, about 3.5 MB for SmolLM2, to both). ``--quick`` (``--shape tiny
--rank 2``): the 2-layer model and rank of ``tests/test_adapter_checkpoints.py``'s CLI test.

    python -m benchmarks.checkpoint_size [--quick] [--shape 135m|tiny] [--rank 8]
        [--checkpoints 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import optax

import edl
from benchmarks._common import table, write_json
from edl.io.checkpoint import save_state
from edl.io.formats.base_ref import reference
from edl.lora import apply_lora, lora_trainable
from edl.models import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def _disk_use(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _saves(state, directory: Path, count: int, base) -> list[float]:
    """Seconds of each of ``count`` saves (steps 1..count, all kept)."""
    seconds = []
    for step in range(1, count + 1):
        start = time.perf_counter()
        save_state(edl.state.replace(state, step=step), directory, keep=None, base=base)
        seconds.append(time.perf_counter() - start)
    return seconds


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="135m", help="the model's shape (default: 135m)"
    )
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default: 8)")
    parser.add_argument(
        "--checkpoints", type=int, default=5, help="checkpoints saved and kept (default: 5)"
    )
    parser.add_argument("--quick", action="store_true", help="--shape tiny --rank 2")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.shape, args.rank = "tiny", 2

    model = LlamaForCausalLM.init(LlamaConfig(**SHAPES[args.shape]), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        edl.save_pretrained(model, work / "base")
        start = time.perf_counter()
        ref = reference(work / "base")
        hash_s = time.perf_counter() - start
        lora = apply_lora(model, rank=args.rank, alpha=2 * args.rank, key=jax.random.key(1))
        state = edl.create_state(lora, optax.adamw(1e-4), trainable=lora_trainable)
        adapter_s = _saves(state, work / "adapters", args.checkpoints, ref)
        full_s = _saves(state, work / "full", args.checkpoints, None)
        adapters, full = _disk_use(work / "adapters"), _disk_use(work / "full")
    result = {
        "shape": args.shape,
        "parameters": edl.count_params(model),
        "adapter_parameters": edl.count_params(edl.split(lora, lora_trainable)[0]),
        "checkpoints": args.checkpoints,
        "adapter_only_mb": round(adapters / 1e6, 1),
        "full_mb": round(full / 1e6, 1),
        "ratio": round(adapters / full, 4),
        "base_hash_s": round(hash_s, 2),
        "adapter_only_save_s_median": round(statistics.median(adapter_s), 3),
        "full_save_s_median": round(statistics.median(full_s), 3),
    }
    print(table(list(result), [list(result.values())]))
    print(f"wrote {write_json('checkpoint_size', [result])}")


if __name__ == "__main__":
    main()
