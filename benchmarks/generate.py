"""Greedy generation throughput: edl ``generate`` vs transformers ``generate``, same weights.

The model benchmark's tiny Llama (hidden 256, intermediate 688, 8 heads / 4 kv heads,
vocab 1024, 4 layers, float32), prompts of 32 tokens, 128 new tokens (no EOS, so every row
runs to the end), batch 1 and 8. edl runs the whole decode loop as one compiled program
(timed after a first call that compiles it); transformers runs its Python loop with a
dynamic cache. New tokens per second = batch * 128 / wall time of one ``generate`` call,
prefill included on both sides.

    python -m benchmarks.generate [--quick] [--impls auto xla]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import edl
from benchmarks._common import table, time_call, write_json
from edl.generate import generate
from edl.models import LlamaConfig, LlamaForCausalLM, configure


def _config(quick: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=64 if quick else 256,
        intermediate_size=172 if quick else 688,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


def _time_edl(model, ids, new, reps):
    start = time.perf_counter()
    jax.block_until_ready(generate(model, ids, max_new_tokens=new).sequences)
    first_s = time.perf_counter() - start
    seconds = time_call(lambda: generate(model, ids, max_new_tokens=new).sequences, **reps)
    return seconds, first_s


def _time_torch(torch_model, ids, new, reps):
    import torch

    ids_t = torch.from_numpy(np.asarray(ids, np.int64))

    def run():
        with torch.no_grad():
            return torch_model.generate(
                ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )  # fmt: skip

    out = run()
    assert out.shape[1] == ids.shape[1] + new
    return time_call(run, **reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small layers, 16 new tokens")
    parser.add_argument("--impls", nargs="+", default=["auto", "xla"],
                        help="edl attention impls to time (auto = Pallas kernels)")  # fmt: skip
    args = parser.parse_args()
    prompt, new = (8, 16) if args.quick else (32, 128)
    reps = {"warmup": 1, "repeats": 3, "number": 1}

    import torch

    torch.manual_seed(0)
    config = _config(args.quick)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    torch_model = edl.to_torch(model)
    rows = []
    for batch in (1, 8):
        ids = np.asarray(jax.random.randint(jax.random.key(batch), (batch, prompt), 1, 1024))
        # edl first: torch's OpenMP workers keep spinning for a while after each call
        # and would steal the 2 cores from XLA's threads.
        edl_times = {
            impl: _time_edl(configure(model, attention_impl=impl), ids, new, reps)
            for impl in args.impls
        }
        torch_s = _time_torch(torch_model, ids, new, reps)
        row = {"batch": batch, "prompt": prompt, "new_tokens": new,
               "torch_tokens_per_s": batch * new / torch_s}  # fmt: skip
        for impl, (seconds, first_s) in edl_times.items():
            row[f"edl_{impl}_tokens_per_s"] = batch * new / seconds
            row[f"edl_{impl}_speedup"] = torch_s / seconds
            row[f"edl_{impl}_first_call_s"] = first_s
        rows.append(row)
        print(f"batch {batch} done", flush=True)
    header = ["batch", "torch tok/s"]
    for impl in args.impls:
        header += [f"edl {impl} tok/s", f"x torch ({impl})", f"compile+run s ({impl})"]
    body = []
    for r in rows:
        cells = [r["batch"], r["torch_tokens_per_s"]]
        for impl in args.impls:
            cells += [r[f"edl_{impl}_tokens_per_s"], r[f"edl_{impl}_speedup"],
                      r[f"edl_{impl}_first_call_s"]]  # fmt: skip
        body.append(cells)
    print(table(header, body))
    print("wrote", write_json("generate", rows, quick=args.quick, layers=config.num_hidden_layers))


if __name__ == "__main__":
    main()
