"""Greedy generation throughput: edl ``generate`` vs transformers ``generate``, same weights.

The model benchmark's tiny Llama (hidden 256, intermediate 688, 8 heads / 4 kv heads,
vocab 1024, 4 layers, float32), prompts of 32 tokens, 128 new tokens (no EOS, so every row
runs to the end), batch 1 and 8. edl runs the whole decode loop as one compiled program
(timed after a first call that compiles it); transformers runs its Python loop with a
dynamic cache. New tokens per second = batch * 128 / wall time of one ``generate`` call,
prefill included on both sides; the fastest of ``--rounds`` interleaved rounds (and the
ratio of medians), each timed call right after an untimed one of itself. Each edl attention
impl is timed with the defaults (layer weights sliced out of their stacks on every decode
step); "<impl>/unstacked" columns time ``unstack_layers=True`` (sliced once, before the
decode loop).

The impls (``edl.ops.cached_attention``): "auto" is what a user gets (on CPU the same program
as "xla"), "xla" reads the cache in place at a decode step, "reference" is the plain grouped
einsum (the A/B for that form), "pallas" the decode kernel (interpreted on CPU).

With ``--engine`` an "engine" column times the same greedy requests through the serving
engine (``edl.serve.Engine``, all admitted at once, stepped until done; no HTTP): the
continuous-batching path against ``generate``'s compiled whole loop, both on
``edl.generate.steps.forward``.

With ``--ceiling`` a "gemms" column times a compiled loop of ``new`` steps that run only a
decode step's matrix products at that batch (the model's shapes, one array per layer, in
edl's ``(W @ x.T).T`` form): tokens/s no decode loop built on XLA's float32 GEMMs can beat
on the machine, whatever its attention, sampling or cache.

    python -m benchmarks.generate [--quick] [--impls auto xla reference pallas] [--unstacked auto]
        [--ceiling] [--engine]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import edl
from benchmarks._common import interleaved_rounds, table, write_json
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


def _edl_call(model, ids, new, impl, unstack_layers):
    model = configure(model, attention_impl=impl)
    return lambda: generate(model, ids, max_new_tokens=new, unstack_layers=unstack_layers).sequences


def _gemm_call(config: LlamaConfig, batch: int, new: int):
    """``new`` steps of a decode step's GEMMs alone at ``batch`` rows (module docstring)."""
    d, inter = config.hidden_size, config.intermediate_size
    head_dim = d // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    shapes = [(qkv, d), (d, config.num_attention_heads * head_dim), (2 * inter, d), (d, inter)]
    keys = iter(jax.random.split(jax.random.key(1), 4 * config.num_hidden_layers + 1))
    layers = [
        [0.05 * jax.random.normal(next(keys), shape) for shape in shapes]
        for _ in range(config.num_hidden_layers)
    ]
    head = 0.05 * jax.random.normal(next(keys), (config.vocab_size, d))

    def linear(w, x):
        return (w @ x.T).T

    @jax.jit
    def run(layers, head, x):
        def step(_, x):
            h = x
            for wqkv, wo, wgu, wdown in layers:
                h = h + linear(wo, linear(wqkv, h)[:, : wo.shape[1]])
                gate_up = linear(wgu, h)
                h = h + linear(wdown, gate_up[:, :inter] * gate_up[:, inter:])
            return x + 1e-3 * linear(head, h)[:, :d]

        return jax.lax.fori_loop(0, new, step, x)

    x = jax.numpy.ones((batch, d))
    return lambda: run(layers, head, x)


def _engine_call(model, ids, new: int):
    """The rows of ``ids`` as greedy engine requests of ``new`` tokens, run to the end."""
    from edl.serve.engine import Engine
    from edl.serve.types import SamplingParams

    rows, prompt = ids.shape
    engine = Engine(model, max_batch=rows, max_model_len=prompt + new, prefix_caching=False)
    params = SamplingParams(max_tokens=new, temperature=0.0)

    def run():
        for row in np.asarray(ids).tolist():
            engine.add_request(row, params)
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
        assert tokens == rows * new, tokens
        return tokens

    return run


def _torch_call(torch_model, ids, new):
    import torch

    ids_t = torch.from_numpy(np.asarray(ids, np.int64))

    def run():
        with torch.no_grad():
            return torch_model.generate(
                ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )

    return run


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 small layers, 16 new tokens")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["auto", "xla", "reference", "pallas"],
        help="edl attention impls to time",
    )
    parser.add_argument(
        "--unstacked", nargs="*", default=["auto"], help="impls also timed with unstack_layers=True"
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument(
        "--ceiling", action="store_true", help="also time a decode step's GEMMs alone (gemms)"
    )
    parser.add_argument(
        "--engine", action="store_true", help="also time the serving engine (engine)"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    variants = {impl: (impl, False) for impl in args.impls}
    variants |= {f"{impl}/unstacked": (impl, True) for impl in args.unstacked}
    timed = [*variants, *(["gemms"] if args.ceiling else []), *(["engine"] if args.engine else [])]
    prompt, new = (8, 16) if args.quick else (32, 128)

    import torch

    torch.manual_seed(0)
    config = _config(args.quick)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    torch_model = edl.to_torch(model)
    rows = []
    for batch in (1, 8):
        ids = np.asarray(jax.random.randint(jax.random.key(batch), (batch, prompt), 1, 1024))
        calls = {name: _edl_call(model, ids, new, *v) for name, v in variants.items()}
        if args.ceiling:
            calls["gemms"] = _gemm_call(config, batch, new)
        if args.engine:
            calls["engine"] = _engine_call(model, ids, new)
        first = {}
        for name, call in calls.items():  # compile + run once
            start = time.perf_counter()
            jax.block_until_ready(call())
            first[name] = time.perf_counter() - start
        calls["torch"] = _torch_call(torch_model, ids, new)
        assert calls["torch"]().shape[1] == prompt + new
        time.sleep(0.5)
        # torch goes last in a round, followed by a pause: its OpenMP workers keep spinning
        # for a while after a call and would take the 2 cores from XLA (measured: ~40% slower).
        # Each call is timed right after an untimed one of itself (warm_each): the first
        # variant after torch (after the pause) used to run ~1.3x slower than the same
        # program later in the round.
        samples = interleaved_rounds(calls, args.rounds, pause_after={"torch"}, warm_each=True)
        # The fastest round of each: the least disturbed by the machine's other load.
        best = {name: min(s) for name, s in samples.items()}
        row = {
            "batch": batch,
            "prompt": prompt,
            "new_tokens": new,
            "rounds": args.rounds,
            "torch_tokens_per_s": batch * new / best["torch"],
            "torch_median_s": statistics.median(samples["torch"]),
        }
        for name in timed:
            row[f"edl_{name}_tokens_per_s"] = batch * new / best[name]
            row[f"edl_{name}_speedup"] = best["torch"] / best[name]
            row[f"edl_{name}_median_speedup"] = statistics.median(
                samples["torch"]
            ) / statistics.median(samples[name])
            row[f"edl_{name}_first_call_s"] = first[name]
        rows.append(row)
        print(f"batch {batch} done", flush=True)
    header = ["batch", "torch tok/s"]
    for name in timed:
        header += [
            f"edl {name} tok/s",
            f"x torch ({name})",
            f"median x ({name})",
            f"compile+run s ({name})",
        ]
    body = []
    for r in rows:
        cells = [r["batch"], r["torch_tokens_per_s"]]
        for name in timed:
            cells += [
                r[f"edl_{name}_tokens_per_s"],
                r[f"edl_{name}_speedup"],
                r[f"edl_{name}_median_speedup"],
                r[f"edl_{name}_first_call_s"],
            ]
        body.append(cells)
    print(table(header, body))
    print("wrote", write_json("generate", rows, quick=args.quick, layers=config.num_hidden_layers))


if __name__ == "__main__":
    main()
