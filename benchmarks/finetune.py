"""SFT fine-tuning throughput, LoRA and full: edl vs transformers + peft, same model, same
data, tokens/s side by side.

Model: a Llama (hidden 512, intermediate 1408, 8 layers, 8 heads / 4 kv heads, vocab 8192,
untied head; ``--quick``: hidden 256, 4 layers, vocab 2048), float32. Both sides get the same
weights: ``LlamaForCausalLM.init`` -> ``edl.save_pretrained`` -> ``edl.from_pretrained`` /
``transformers.AutoModelForCausalLM.from_pretrained``.

Data: synthetic SFT examples (a prompt of 16-96 tokens with labels -100, then a completion
of 16-160 tokens; random ids), packed by edl's own ``edl.train.TokenBatches`` into rows of
``seq`` tokens (examples whole, several per row, ``position_ids`` restarting at 0 in each,
``segment_ids``, labels -100 on prompts and padding). Both sides train on **the same packed
rows**, in the same order, and neither side attends across examples:

- edl: ``model.compute_loss(input_ids, labels=, segment_ids=, position_ids=)`` as
  ``edl train`` does (segment-masked attention; the loss skips each segment's first token);
- torch: ``model(input_ids, position_ids=, labels=, use_cache=False)``, no ``attention_mask``:
  transformers 5 then finds the packed examples from the restarting ``position_ids``
  (``masking_utils.find_packed_sequence_indices``) and gives SDPA a block-diagonal causal
  mask (the same semantics as ``DataCollatorWithFlattening``; pads, at position 0, each
  become a one-token sequence with label -100). ``use_cache=False`` matters: with the
  default cache transformers skips that detection and the examples attend to each other
  (its loss then differs from the per-example one). The prompt's first token has label -100,
  so HF's shifted loss and edl's per-segment loss count the same targets: the script checks
  that both losses agree on the first batch before timing.

So the work is identical (same rows, same padding, same targets); only the implementations
differ. tokens/s counts real tokens only (``attention_mask`` = 1: prompt + completion, not
padding), the same count for both; the rows' fill rate is printed.

Steps: LoRA (rank 8, alpha 16, dropout 0, on q/k/v/o/gate/up/down projections: edl's
``apply_lora`` default pattern, peft ``target_modules`` of the same names; only the adapters
train) and full fine-tuning; AdamW (lr 1e-4, weight decay 0.01, eps 1e-8) in both, no
clipping. edl: ``make_train_step(loss_fn, tx)`` (jitted, donated state) on
``edl.create_state(model, tx[, trainable=lora_trainable])``. torch: ``loss.backward();
opt.step(); opt.zero_grad(set_to_none=True)``, ``torch.set_num_threads(os.cpu_count())``.

Timing: each side's first step (edl: trace + compile + run; torch: first run) is reported
on its own. Then ``interleaved_rounds(..., warm_each=True)``: every round runs each of the
four variants on the round's batch (once untimed on the batch before it, then timed), so
drifting load hits all alike and edl and torch see the same batch in the same round;
"edl/torch" is the median over rounds of the paired tokens/s ratio; "best" is each side's
fastest round and their ratio. The load average is printed before and after: on a shared
machine torch's OpenMP threads lose far more than XLA's to other processes (its steps ran
5-6x slower, XLA's ~2x, when another job took both cores of the 2-core VM), so rounds
run under contention favour edl.

jax picks its device (on a GPU the edl side runs there; ``--dtype bfloat16`` for both
sides); torch runs on CUDA when its build has it, else CPU.

    python -m benchmarks.finetune [--quick] [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from benchmarks._common import interleaved_rounds, table, write_json
from edl.lora import apply_lora, lora_trainable
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import TokenBatches, make_train_step

LORA = {"rank": 8, "alpha": 16}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAMW = {"lr": 1e-4, "weight_decay": 0.01, "eps": 1e-8}
VARIANTS = ("lora", "full")


def _config(quick: bool) -> tuple[LlamaConfig, int, int]:
    """The model, and batch x seq."""
    if quick:
        fields = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4)
        batch, seq = 4, 256
    else:
        fields = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8)
        batch, seq = 4, 512
    config = LlamaConfig(
        **fields,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return config, batch, seq


def _examples(n: int, vocab: int, scale: float, seed: int = 0) -> list[dict]:
    """``n`` SFT examples: a prompt (labels -100) then a completion (labels = ids)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        prompt = int(rng.integers(16, 97) * scale)
        completion = int(rng.integers(16, 161) * scale)
        ids = rng.integers(0, vocab, prompt + completion).astype(np.int32)
        labels = np.concatenate([np.full(prompt, -100, np.int32), ids[prompt:]])
        docs.append({"input_ids": ids, "labels": labels})
    return docs


def _batches(config, batch: int, seq: int, count: int) -> list[dict[str, np.ndarray]]:
    docs = _examples(64 * count, config.vocab_size, seq / 512)
    it = TokenBatches(docs, batch_size=batch, max_length=seq, pad_id=0, seed=0)
    return [next(it) for _ in range(count)]


def _edl_step(model, lora: bool, batches, dtype):
    """``(first-step seconds, call)``: ``call()`` runs one step on the next batch."""
    if lora:
        model = apply_lora(model, rank=LORA["rank"], alpha=LORA["alpha"], key=jax.random.key(1))
    model = edl.module.to_dtype(model, dtype)
    tx = optax.adamw(ADAMW["lr"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])

    def loss_fn(model, batch):
        return model.compute_loss(
            batch["input_ids"],
            labels=batch["labels"],
            segment_ids=batch["segment_ids"],
            position_ids=batch["position_ids"],
        )

    step = make_train_step(loss_fn, tx)
    keys = ("input_ids", "labels", "segment_ids", "position_ids")
    data = [{k: jnp.asarray(b[k]) for k in keys} for b in batches]
    box = [edl.create_state(model, tx, trainable=lora_trainable if lora else None), 0]

    def call():
        state, i = box
        box[0], metrics = step(state, data[i % len(data)])
        box[1] = i + 1
        return metrics["loss"]

    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start, call


def _torch_model(path: str, lora: bool, dtype, device):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if lora:
        import peft

        lora_config = peft.LoraConfig(
            r=LORA["rank"],
            lora_alpha=LORA["alpha"],
            target_modules=TARGET_MODULES,
            lora_dropout=0.0,
        )
        model = peft.get_peft_model(model, lora_config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAMW)
    return model, opt, sum(p.numel() for p in params)


def _torch_loss(model, b):
    """HF's loss on packed rows: no ``attention_mask``, restarting ``position_ids``, and no
    cache: with one (``use_cache`` defaults to True, in train mode too) transformers skips
    its packed-sequence detection and the examples of a row attend to each other."""
    return model(
        input_ids=b["input_ids"],
        position_ids=b["position_ids"],
        labels=b["labels"],
        use_cache=False,
    ).loss


def _torch_step(model, opt, batches, device):
    """``(first-step seconds, call)``, as ``_edl_step``."""
    import torch

    data = [
        {
            k: torch.from_numpy(b[k].astype(np.int64)).to(device)
            for k in ("input_ids", "labels", "position_ids")
        }
        for b in batches
    ]
    box = [0]

    def call():
        b = data[box[0] % len(data)]
        box[0] += 1
        loss = _torch_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        return loss.item()

    start = time.perf_counter()
    call()
    return time.perf_counter() - start, call


def _check_losses(edl_model, torch_model, batch, device) -> tuple[float, float]:
    """Both sides' loss on ``batch`` before any training (same weights, B = 0)."""
    import torch

    b = {k: jnp.asarray(v) for k, v in batch.items()}
    edl_loss = edl_model.compute_loss(
        b["input_ids"],
        labels=b["labels"],
        segment_ids=b["segment_ids"],
        position_ids=b["position_ids"],
    )[0]
    t = {k: torch.from_numpy(v.astype(np.int64)).to(device) for k, v in batch.items()}
    with torch.no_grad():
        torch_loss = _torch_loss(torch_model, t)
    return float(edl_loss), float(torch_loss)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, seq 256")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (5; quick 3)")
    parser.add_argument("--dtype", default="float32", help="both sides' weights and compute")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)

    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = jnp.dtype(args.dtype)
    torch_dtype = getattr(torch, args.dtype)
    config, batch, seq = _config(args.quick)
    # The first step, then per round one untimed and one timed step (warm_each).
    batches = _batches(config, batch, seq, 1 + 2 * rounds)
    real = [int(b["attention_mask"].sum()) for b in batches]
    targets = [int((b["labels"] != -100).sum()) for b in batches]
    examples = [int(b["segment_ids"].max(axis=1).sum()) for b in batches]
    print(
        f"{batch} x {seq} packed rows: {statistics.mean(examples):.1f} examples and "
        f"{statistics.mean(real):.0f} real tokens per batch (fill "
        f"{statistics.mean(real) / (batch * seq):.0%}), {statistics.mean(targets):.0f} "
        "completion (loss) tokens",
        flush=True,
    )

    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    params = edl.count_params(model)
    first, calls, trainable = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="edl-finetune-") as tmp:
        edl.save_pretrained(model, tmp)
        del model
        for variant in VARIANTS:
            lora = variant == "lora"
            tm, opt, trainable[variant] = _torch_model(tmp, lora, torch_dtype, device)
            em = edl.from_pretrained(tmp)
            if variant == "lora":
                edl_loss, torch_loss = _check_losses(
                    edl.module.to_dtype(em, dtype), tm, batches[0], device
                )
                print(
                    f"loss on batch 0 before training: edl {edl_loss:.6f}, torch {torch_loss:.6f}",
                    flush=True,
                )
                if not np.isclose(edl_loss, torch_loss, rtol=1e-4):
                    raise AssertionError("edl and torch compute different losses")
            # torch first: its first step, then edl's compile, as separate figures.
            first[f"torch {variant}"], calls[f"torch {variant}"] = _torch_step(
                tm, opt, batches, device
            )
            first[f"edl {variant}"], calls[f"edl {variant}"] = _edl_step(em, lora, batches, dtype)
            print(
                f"{variant}: first step edl {first[f'edl {variant}']:.2f} s, "
                f"torch {first[f'torch {variant}']:.2f} s",
                flush=True,
            )

    order = [f"{side} {v}" for v in VARIANTS for side in ("edl", "torch")]
    samples = interleaved_rounds({name: calls[name] for name in order}, rounds, warm_each=True)
    # Batch 0 was the first step; round r's untimed call ran batch 1 + 2r, its timed one 2 + 2r.
    timed = [real[2 + 2 * r] for r in range(rounds)]
    rows = []
    for variant in VARIANTS:
        rate = {
            side: [n / t for n, t in zip(timed, samples[f"{side} {variant}"], strict=True)]
            for side in ("edl", "torch")
        }
        ratios = [e / t for e, t in zip(rate["edl"], rate["torch"], strict=True)]
        rows.append(
            {
                "variant": variant,
                "trainable_params": trainable[variant],
                "edl_tokens_per_s": statistics.median(rate["edl"]),
                "torch_tokens_per_s": statistics.median(rate["torch"]),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "edl_best_tokens_per_s": max(rate["edl"]),
                "torch_best_tokens_per_s": max(rate["torch"]),
                "best_ratio": max(rate["edl"]) / max(rate["torch"]),
                "edl_step_s": statistics.median(samples[f"edl {variant}"]),
                "torch_step_s": statistics.median(samples[f"torch {variant}"]),
                "edl_first_step_s": first[f"edl {variant}"],
                "torch_first_step_s": first[f"torch {variant}"],
                "edl_rates": rate["edl"],
                "torch_rates": rate["torch"],
            }
        )
    print(
        f"params {params:,}, {batch} x {seq}, {args.dtype}, {rounds} rounds; "
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
        f"({device}, {torch.get_num_threads()} threads), transformers "
        f"{transformers.__version__}"
    )
    print(
        table(
            [
                "variant",
                "trainable",
                "edl tok/s",
                "torch tok/s",
                "edl/torch",
                "range",
                "best: edl / torch / ratio",
                "edl step s",
                "torch step s",
                "edl 1st s",
                "torch 1st s",
            ],
            [
                [
                    r["variant"],
                    f"{r['trainable_params']:,}",
                    r["edl_tokens_per_s"],
                    r["torch_tokens_per_s"],
                    r["ratio"],
                    f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                    f"{r['edl_best_tokens_per_s']:.4g} / {r['torch_best_tokens_per_s']:.4g} / "
                    f"{r['best_ratio']:.3g}",
                    r["edl_step_s"],
                    r["torch_step_s"],
                    r["edl_first_step_s"],
                    r["torch_first_step_s"],
                ]
                for r in rows
            ],
        )
    )
    path = write_json(
        "finetune",
        rows,
        quick=args.quick,
        params=params,
        batch=batch,
        seq=seq,
        dtype=args.dtype,
        rounds=rounds,
        real_tokens=real,
        loss_tokens=targets,
        examples=examples,
        loss_check={"edl": edl_loss, "torch": torch_loss},
        torch=torch.__version__,
        torch_device=device,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
        lora=LORA,
        adamw=ADAMW,
        load_average=os.getloadavg(),
    )
    print(f"load average {os.getloadavg()[0]:.2f} at the end; wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
