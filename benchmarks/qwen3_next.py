"""Qwen3-Next tiny: forward and train step, edl (jax.jit) vs transformers + torch, and the
gated delta rule's chunked form vs its recurrent reference.

The model: hidden 256, 8 layers (three Gated DeltaNet layers then a full-attention one,
twice), 8 heads / 2 kv heads of 64 (partial rotary 0.25), DeltaNet 4 key / 8 value heads of
64, 16 experts (top 4, width 128) plus a shared expert of 256, vocab 1024; batch 2 x seq
256, float32. Both sides get the same weights (``edl.to_torch``) and batch. The train step
is AdamW on the causal-LM loss (edl: chunked loss; torch: HF's loss on full logits). torch
runs transformers' reference PyTorch delta rule and conv (flash-linear-attention and
causal-conv1d are not installed on CPU). Each side runs in its own process (``--side``):
with torch and jax in one process the train step stalled on this VM. Medians of rounds.

The delta rule alone: batch 1, 8 heads of 64 / 64, at seq 256, 1024 and 4096, forward, the
XLA chunked form (chunks of 64) vs the recurrent ``lax.scan`` over tokens.

Packed sequences (``--side resets``): the chunked delta rule's forward + backward at batch 2
x 1024 tokens without ``resets``, with resets that mark nothing (what a padded batch of
Qwen3-Next pays: its layers always pass the attention mask's segment ids) and with eight
packed segments per row.

The kernels (``--side kernel``): forward + backward of ``gated_delta_rule(impl="auto")``
(on a GPU the Triton chunk scan and its Pallas backward, ``edl.kernels.delta_rule_bwd``; on
a TPU the Mosaic ones; on CPU the XLA form, so both columns time the same program there)
vs the XLA chunked form, batch 2 x 8 heads of 128 / 128, at seq 1024 and 4096.

    python -m benchmarks.qwen3_next --side {delta,resets,kernel,edl,torch} [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
import edl.train
from benchmarks._common import interleaved_rounds, table, write_json
from edl.models import Qwen3NextConfig, Qwen3NextForCausalLM
from edl.ops.delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
)


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _batch() -> np.ndarray:
    return np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 256))


def _model() -> Qwen3NextForCausalLM:
    return Qwen3NextForCausalLM.init(Qwen3NextConfig(**CONFIG), key=jax.random.key(0))


def edl_rows(rounds: int) -> dict[str, float]:
    """edl's forward and train step (median ms), this process holding no torch."""
    model, jids = _model(), jnp.asarray(_batch())
    forward = jax.jit(lambda m, i: m(i).logits)
    tx = optax.adamw(1e-4)
    step = edl.train.make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=False)
    state, batch = edl.create_state(model, tx), {"ids": jids}
    samples = interleaved_rounds(
        {
            "forward": lambda: forward(model, jids),
            "train step": lambda: step(state, batch)[1]["loss"],
        },
        rounds + 1,
        warm_each=True,
    )
    return {k: _median_ms(v[1:]) for k, v in samples.items()}


def torch_rows(rounds: int) -> dict[str, float]:
    """transformers + torch on the same weights (``edl.to_torch``) and batch."""
    import time

    import torch

    torch_model = edl.to_torch(_model()).eval()
    tids = torch.tensor(_batch())
    opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4)

    def forward():
        with torch.no_grad():
            return torch_model(tids).logits

    def train_step():
        opt.zero_grad()
        torch_model(tids, labels=tids).loss.backward()
        opt.step()

    out = {}
    for name, fn in (("forward", forward), ("train step", train_step)):
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = _median_ms(times)
    return out


def delta_rule_rows(rounds: int) -> list[dict]:
    rows = []
    chunked = jax.jit(chunked_gated_delta_rule)
    recurrent = jax.jit(recurrent_gated_delta_rule)
    for seq in (256, 1024, 4096):
        ks = jax.random.split(jax.random.key(seq), 5)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        q = unit(jax.random.normal(ks[0], (1, seq, 8, 64)))
        k = unit(jax.random.normal(ks[1], (1, seq, 8, 64)))
        v = jax.random.normal(ks[2], (1, seq, 8, 64))
        g = -jax.nn.softplus(jax.random.normal(ks[3], (1, seq, 8)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, seq, 8)))
        args = (q, k, v, g, beta)
        for fn in (chunked, recurrent):
            jax.block_until_ready(fn(*args))
        samples = interleaved_rounds(
            {"chunked": lambda a=args: chunked(*a), "recurrent": lambda a=args: recurrent(*a)},
            rounds,
            warm_each=True,
        )
        c, r = _median_ms(samples["chunked"]), _median_ms(samples["recurrent"])
        rows.append({"seq": seq, "chunked_ms": c, "recurrent_ms": r, "speedup": r / c})
    return rows


def resets_rows(rounds: int) -> list[dict]:
    """Forward + backward of the chunked delta rule (median ms) with and without resets."""
    seq = 1024
    ks = jax.random.split(jax.random.key(0), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (2, seq, 8, 64)))
    k = unit(jax.random.normal(ks[1], (2, seq, 8, 64)))
    v = jax.random.normal(ks[2], (2, seq, 8, 64))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, seq, 8)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, seq, 8)))
    packed = np.zeros((2, seq), bool)
    packed[:, np.arange(1, 8) * seq // 8 + 5] = True  # eight segments per row

    def program(resets):
        def loss(*a):
            out, state = chunked_gated_delta_rule(*a, None, resets)
            return jnp.sum(out**2) + jnp.sum(state**2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    cases = {
        "no resets": program(None),
        "resets marking nothing": program(jnp.zeros((2, seq), bool)),
        "8 segments per row": program(jnp.asarray(packed)),
    }
    args = (q, k, v, g, beta)
    samples = interleaved_rounds(
        {name: lambda f=f: f(*args) for name, f in cases.items()}, rounds + 1, warm_each=True
    )
    base = _median_ms(samples["no resets"][1:])
    return [
        {"case": name, "ms": _median_ms(t[1:]), "vs_none": _median_ms(t[1:]) / base}
        for name, t in samples.items()
    ]


def kernel_rows(rounds: int) -> list[dict]:
    """Forward + backward (median ms) of ``impl="auto"`` (the platform's kernels) vs the
    XLA chunked form."""
    rows = []
    for seq in (1024, 4096):
        ks = jax.random.split(jax.random.key(seq), 5)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        q, k = (unit(jax.random.normal(key, (2, seq, 8, 128))) for key in ks[:2])
        v = jax.random.normal(ks[2], (2, seq, 8, 128))
        g = -jax.nn.softplus(jax.random.normal(ks[3], (2, seq, 8)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, seq, 8)))

        def program(impl):
            def loss(*a):
                out, state = gated_delta_rule(*a, impl=impl)
                return jnp.sum(out**2) + jnp.sum(state**2)

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

        fns = {impl: program(impl) for impl in ("auto", "chunked")}
        args = (q, k, v, g, beta)
        samples = interleaved_rounds(
            {name: lambda f=f, a=args: f(*a) for name, f in fns.items()},
            rounds + 1,
            warm_each=True,
        )
        auto, xla = (_median_ms(samples[name][1:]) for name in ("auto", "chunked"))
        rows.append({"seq": seq, "auto_ms": auto, "chunked_ms": xla, "speedup": xla / auto})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds; medians reported")
    parser.add_argument(
        "--side",
        choices=("delta", "resets", "kernel", "edl", "torch"),
        required=True,
        help="what this process times: the delta rule's two forms, its resets (packed "
        "sequences), its kernels' forward + backward, edl's model, or torch's",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.side == "resets":
        rows = resets_rows(args.rounds)
        header = ["case", "fwd + bwd ms", "vs no resets"]
        cells = [[r["case"], r["ms"], r["vs_none"]] for r in rows]
    elif args.side == "kernel":
        rows = kernel_rows(args.rounds)
        header = ["seq", "auto (kernels) ms", "chunked (XLA) ms", "chunked / auto"]
        cells = [[r["seq"], r["auto_ms"], r["chunked_ms"], r["speedup"]] for r in rows]
    elif args.side == "delta":
        rows = delta_rule_rows(args.rounds)
        header = ["seq", "chunked ms", "recurrent ms", "recurrent / chunked"]
        cells = [[r["seq"], r["chunked_ms"], r["recurrent_ms"], r["speedup"]] for r in rows]
    else:
        times = (edl_rows if args.side == "edl" else torch_rows)(args.rounds)
        rows = [{"side": args.side, "what": k, "ms": v} for k, v in times.items()]
        header, cells = ["side", "what", "ms"], [[r["side"], r["what"], r["ms"]] for r in rows]
    print(table(header, cells), flush=True)
    write_json(f"qwen3_next_{args.side}", rows, config=CONFIG)


if __name__ == "__main__":
    main()
