"""DeepSeek-V3 tiny: forward and train-step time, edl (jax.jit) vs transformers + torch, and
decode tokens/s with MLA's latent cache vs the materialised per-head cache.

The model: hidden 256, 8 heads, q_lora_rank 192, kv_lora_rank 128, qk_nope 32 + qk_rope 16,
v_head_dim 32, 4 layers (1 dense, then 3 MoE of 16 experts, top-4 in 2 of 4 groups, one
shared expert), vocab 1024, float32. Both sides get the same weights (``edl.to_torch``) and
batch (4 x 256 tokens). The train step is AdamW on the causal-LM loss (edl: chunked loss;
torch: HF's loss on full logits). Decode: ``edl.generate`` greedy, batch 8, a 64-token
prompt, 64 new tokens, through the latent cache (one array of 128 + 16 features per token
and layer, read absorbed) and through per-head keys / values (8 heads x 48 features for keys
and for values: ``mla_cache="materialised"``). Medians of interleaved rounds.

    python -m benchmarks.deepseek_v3 [--rounds 7] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from benchmarks._common import interleaved_rounds, table, write_json
from edl.generate import generate, init_cache
from edl.models import DeepseekV3Config, DeepseekV3ForCausalLM, configure
from edl.train import make_train_step

TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
)


def _torch_side(model, ids):
    import torch

    torch_model = edl.to_torch(model).train()
    opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4)
    t_ids = torch.tensor(np.asarray(ids, np.int64))

    def forward():
        with torch.no_grad():
            return torch_model(t_ids).logits

    def train():
        opt.zero_grad()
        loss = torch_model(t_ids, labels=t_ids).loss
        loss.backward()
        opt.step()
        return loss

    return forward, train


def _edl_side(model, ids):
    tx = optax.adamw(1e-4)
    # The step donates its state: give it copies, so the forward and decode keep theirs.
    state = [edl.create_state(jax.tree.map(jnp.copy, model), tx)]
    step = make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx)
    forward = jax.jit(lambda m, i: m(i).logits)

    def train():
        state[0], metrics = step(state[0], {"ids": ids})
        return metrics["loss"]

    return (lambda: forward(model, ids)), train


def _decode_rates(model, rounds: int, new: int) -> dict[str, float]:
    """Median tokens/s of greedy decoding per cache form (prefill included, compiled once)."""
    prompt = jnp.asarray(np.random.default_rng(1).integers(1, 1024, (8, 64)))
    forms = {"latent": model, "materialised": configure(model, mla_cache="materialised")}
    calls = {
        name: (lambda m=m: generate(m, prompt, max_new_tokens=new).sequences)
        for name, m in forms.items()
    }
    for call in calls.values():
        jax.block_until_ready(call())
    seconds = interleaved_rounds(calls, rounds)
    return {name: 8 * new / statistics.median(s) for name, s in seconds.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.deepseek_v3", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per variant")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per row")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    config = DeepseekV3Config(**TINY)
    model = DeepseekV3ForCausalLM.init(config, key=jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 1024, (4, 256)))
    e_fwd, e_train = _edl_side(model, ids)
    t_fwd, t_train = _torch_side(model, ids)
    calls = {"edl forward": e_fwd, "torch forward": t_fwd, "edl train": e_train}
    calls["torch train"] = t_train
    for call in calls.values():  # compile / warm up
        jax.block_until_ready(call())
    start = time.perf_counter()
    seconds = interleaved_rounds(calls, args.rounds, pause_after=("torch forward", "torch train"))
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    rows = [
        ["forward", medians["edl forward"] * 1e3, medians["torch forward"] * 1e3],
        ["train step", medians["edl train"] * 1e3, medians["torch train"] * 1e3],
    ]
    rows = [[*r, r[1] / r[2]] for r in rows]
    print(table(["4 x 256 tokens", "edl ms", "torch ms", "edl / torch"], rows))
    rates = _decode_rates(model, args.rounds, args.new_tokens)
    cache = {
        name: sum(x.nbytes for x in jax.tree.leaves(init_cache(m.config, 8, 128)))
        for name, m in (
            ("latent", model),
            ("materialised", configure(model, mla_cache="materialised")),
        )
    }
    decode_rows = [[name, rates[name], cache[name] / 2**20] for name in rates]
    print(table(["decode, batch 8", "tokens/s", "cache MiB (128 tokens)"], decode_rows))
    print(f"({time.perf_counter() - start:.0f} s timed)")
    write_json(
        "deepseek_v3",
        [dict(zip(["what", "edl_ms", "torch_ms", "ratio"], r, strict=True)) for r in rows]
        + [dict(zip(["cache", "tokens_per_s", "cache_mib"], r, strict=True)) for r in decode_rows],
        config=TINY,
    )


if __name__ == "__main__":
    main()
