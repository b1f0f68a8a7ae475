"""Qwen3-Next tiny: forward and train step, edl (jax.jit) vs transformers + torch, and the
gated delta rule's chunked form vs its recurrent reference.

The model: hidden 256, 8 layers (three Gated DeltaNet layers then a full-attention one,
twice), 8 heads / 2 kv heads of 64 (partial rotary 0.25), DeltaNet 4 key / 8 value heads of
64, 16 experts (top 4, width 128) plus a shared expert of 256, vocab 1024; batch 2 x seq
256, float32. Both sides get the same weights (``edl.to_torch``) and batch. The train step
is AdamW on the causal-LM loss (edl: chunked loss; torch: HF's loss on full logits). torch
runs transformers' reference PyTorch delta rule and conv (flash-linear-attention and
causal-conv1d are not installed on CPU). Medians of interleaved rounds.

The delta rule alone: batch 1, 8 heads of 64 / 64, at seq 256, 1024 and 4096, forward, the
XLA chunked form (chunks of 64) vs the recurrent ``lax.scan`` over tokens.

    python -m benchmarks.qwen3_next [--rounds 7]
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
from edl.ops.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule

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


def model_rows(rounds: int) -> list[dict]:
    import torch

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM.init(Qwen3NextConfig(**CONFIG), key=jax.random.key(0))
    torch_model = edl.to_torch(model).eval()
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 256))
    jids = jnp.asarray(ids)
    tids = torch.tensor(ids)

    forward = jax.jit(lambda m, i: m(i).logits)
    tx = optax.adamw(1e-4)
    step = edl.train.make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=False)
    state = edl.create_state(model, tx)
    batch = {"ids": jids}
    opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4)

    def torch_forward():
        with torch.no_grad():
            return torch_model(tids).logits

    def torch_step():
        opt.zero_grad()
        loss = torch_model(tids, labels=tids).loss
        loss.backward()
        opt.step()
        return loss

    for fn in (lambda: forward(model, jids), lambda: step(state, batch)[1]["loss"]):
        jax.block_until_ready(fn())  # compile
    samples = interleaved_rounds(
        {
            "edl forward": lambda: forward(model, jids),
            "torch forward": torch_forward,
            "edl train step": lambda: step(state, batch)[1]["loss"],
            "torch train step": torch_step,
        },
        rounds,
        warm_each=True,
    )
    rows = []
    for what in ("forward", "train step"):
        e, t = _median_ms(samples[f"edl {what}"]), _median_ms(samples[f"torch {what}"])
        rows.append({"what": what, "edl_ms": e, "torch_ms": t, "edl_over_torch": e / t})
    return rows


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = model_rows(args.rounds)
    print(
        table(
            ["what", "edl ms", "torch ms", "edl / torch"],
            [[r["what"], r["edl_ms"], r["torch_ms"], r["edl_over_torch"]] for r in model],
        )
    )
    delta = delta_rule_rows(args.rounds)
    print(
        table(
            ["seq", "chunked ms", "recurrent ms", "recurrent / chunked"],
            [[r["seq"], r["chunked_ms"], r["recurrent_ms"], r["speedup"]] for r in delta],
        )
    )
    write_json("qwen3_next", model + delta, config=CONFIG)


if __name__ == "__main__":
    main()
