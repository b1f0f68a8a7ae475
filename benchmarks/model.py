"""Llama (and Mixtral) forward, train step and compile time: edl (jax.jit) vs transformers +
torch, and vs EasyDeL 0.3.0 in its own environment.

The issue's config: hidden 256, intermediate 688, 8 heads / 4 kv heads, vocab 1024,
batch 4 x seq 256, float32, at 4, 16 and 32 layers; plus a Mixtral-style row of the same
widths with 8 experts, top-2, in every layer (edl: sorted, blocked expert dispatch; HF: its
loop over the experts hit). edl and torch get the same weights (edl.to_torch) and batch, run
in this process one after the other; EasyDeL runs ``benchmarks/easydel_llama.py`` with the
interpreter given by ``--easydel-python`` (or ``$EDL_EASYDEL_PYTHON``; its own jax), the same
config with its own random weights, Llama rows only. The table reports edl / torch and
edl / EasyDeL ratios. The train step is AdamW on the causal-LM loss (edl: chunked loss,
never forming float32 logits; torch: HF's loss on full logits; EasyDeL: optax cross entropy
on full logits). Compile time is the train step's trace + lower + compile; scan keeps it flat
in depth.

The process re-executes itself once with glibc malloc's huge pages
(``edl.cli.allocator``; ``EDL_HUGE_PAGES=0`` keeps the environment), as the ``edl`` command
does, so all sides run under them; the EasyDeL subprocess inherits them.

It also says how close to the machine's matmul rate each side gets: the matmul FLOPs of each
call (``edl.models.flops_per_token``: every projection, the LM head, causal attention; no
elementwise work) per second, as a fraction of the best single-GEMM rate any backend reaches
here (a 2048^3 float32 GEMM in torch and in XLA, measured in the same run).

    python -m benchmarks.model [--quick] [--layers 4 16 32] [--moe-layers 4]
                               [--easydel-python /path/to/easydel-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from benchmarks._common import table, time_call, write_json
from edl.cli.allocator import reexec_with_huge_pages
from edl.models import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    flops_per_token,
)

# Issue 31: edl time / other side's time, at most.
TARGETS = {"forward_vs_torch": 0.95, "train_vs_torch": 1.15, "train_vs_easydel": 0.75}

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}


def _config(family: str, layers: int, quick: bool):
    extra = {"num_experts": 8, "num_experts_per_tok": 2} if family == "mixtral" else {}
    return FAMILIES[family][0](
        vocab_size=1024,
        hidden_size=256 if not quick else 64,
        intermediate_size=688 if not quick else 172,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        **extra,
    )


def _edl_fns(model, tx):
    state = edl.create_state(model, tx)

    def loss_fn(model, ids):
        return model.compute_loss(ids)[0]

    def step(state, ids):
        loss, grads = edl.value_and_grad(loss_fn)(state, ids)
        return edl.apply_gradients(state, grads, tx), loss

    forward = jax.jit(lambda model, ids: model(ids).logits)
    return state, jax.jit(step, donate_argnums=0), forward


def _measure_edl(model, ids, reps):
    tx = optax.adamw(1e-4)
    state, step, forward = _edl_fns(model, tx)
    start = time.perf_counter()
    compiled = step.lower(state, ids).compile()
    compile_s = time.perf_counter() - start
    fwd = time_call(lambda: forward(model, ids), **reps)
    box = [state]

    def train():
        box[0], loss = compiled(box[0], ids)
        return loss

    return fwd, time_call(train, **reps), compile_s


def _measure_torch(model, ids_np, reps):
    import torch

    torch_model = edl.to_torch(model)
    ids = torch.from_numpy(np.asarray(ids_np, np.int64))
    opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4)

    def forward():
        with torch.no_grad():
            return torch_model(ids).logits

    def train():
        loss = torch_model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # time_call blocks on jax outputs only; torch CPU ops are synchronous anyway.
    return time_call(forward, **reps), time_call(train, **reps)


def _gemm_seconds(rows: int, cols: int, out: int, number: int, reps) -> tuple[float, float]:
    """Seconds of one ``x @ w.T`` (torch's weight layout), ``x (rows, cols)`` and
    ``w (out, cols)`` in float32: ``(XLA, torch)``."""
    import torch

    x = np.random.default_rng(0).normal(size=(rows, cols)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(out, cols)).astype(np.float32)
    xj, wj, xt, wt = jnp.asarray(x), jnp.asarray(w), torch.from_numpy(x), torch.from_numpy(w)
    mm = jax.jit(lambda x, w: jnp.einsum("ti,oi->to", x, w))
    gemm_reps = {**reps, "number": number}
    return (
        time_call(lambda: mm(xj, wj), **gemm_reps),
        time_call(lambda: torch.nn.functional.linear(xt, wt), **gemm_reps),
    )


def _gemm_ratio(tokens: int, dim: int, hidden: int, reps) -> float:
    """edl/torch time of one MLP projection GEMM alone: the backends' matmul floor."""
    xla_s, torch_s = _gemm_seconds(tokens, dim, hidden, 20, reps)
    return xla_s / torch_s


def _peak_gemm_flops(reps) -> float:
    """FLOP/s of the faster of torch and XLA on one 2048^3 float32 GEMM: the most matmul
    throughput this machine gives any implementation."""
    n = 2048
    return 2 * n**3 / min(_gemm_seconds(n, n, n, 3, reps))


def _matmul_rates(config, tokens: int, seq: int, times: dict[str, float], peak: float) -> dict:
    """Matmul FLOP/s of each measured call (``times``: ``"edl_train"`` -> seconds, ...) and
    its fraction of ``peak``."""
    out = {}
    for name, seconds in times.items():
        if seconds is None:
            continue
        kind = name.split("_", 1)[1]  # "forward" or "train"
        flops = tokens * flops_per_token(config, seq, training=kind == "train")
        out[f"{name}_flops_per_s"] = flops / seconds
        out[f"{name}_peak_fraction"] = flops / seconds / peak
    return out


def _measure_easydel(python: str | None, layers: int, batch: int, seq: int, quick: bool, reps):
    """EasyDeL's forward and train-step seconds from ``benchmarks/easydel_llama.py`` run by
    ``python``, or Nones when no interpreter is given."""
    if python is None:
        return None, None
    script = Path(__file__).with_name("easydel_llama.py")
    command = [
        python,
        str(script),
        "--layers",
        str(layers),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--warmup",
        str(reps["warmup"]),
        "--repeats",
        str(reps["repeats"]),
    ]
    if quick:
        command += ["--hidden", "64", "--intermediate", "172"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["forward_s"], result["train_step_s"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small widths, 2 and 4 layers")
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="dense Llama depths to time (default 4 16 32; quick 2 4)",
    )
    parser.add_argument(
        "--moe-layers",
        type=int,
        nargs="*",
        default=None,
        help="Mixtral-style rows (8 experts, top-2); none to skip",
    )
    parser.add_argument(
        "--easydel-python",
        default=os.environ.get("EDL_EASYDEL_PYTHON"),
        help="python of a venv with easydel==0.3.0 (default $EDL_EASYDEL_PYTHON;"
        " none: no EasyDeL columns)",
    )
    return parser


def main() -> None:
    reexec_with_huge_pages(["-m", "benchmarks.model", *sys.argv[1:]])
    jnp.zeros(())  # initialise the backend before timing anything
    args = build_parser().parse_args()
    layer_counts = args.layers or ([2, 4] if args.quick else [4, 16, 32])
    moe_counts = [2] if args.quick else [4]
    moe_counts = moe_counts if args.moe_layers is None else args.moe_layers
    batch, seq = (2, 64) if args.quick else (4, 256)
    reps = {"warmup": 2, "repeats": 3 if args.quick else 5, "number": 1}

    import torch

    torch.manual_seed(0)
    peak = _peak_gemm_flops(reps)
    print(f"best 2048^3 float32 GEMM (torch or XLA): {peak / 1e9:.0f} GFLOP/s")
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    rows = []
    runs = [("llama", n) for n in layer_counts] + [("mixtral", n) for n in moe_counts]
    for family, layers in runs:
        config = _config(family, layers, args.quick)
        model = FAMILIES[family][1].init(config, key=jax.random.key(layers))
        ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size)
        # torch first: the edl train step donates (deletes) the model's arrays.
        torch_fwd, torch_train = _measure_torch(model, np.asarray(ids), reps)
        edl_fwd, edl_train, compile_s = _measure_edl(model, ids, reps)
        python = args.easydel_python if family == "llama" else None
        easydel_fwd, easydel_train = _measure_easydel(python, layers, batch, seq, args.quick, reps)
        times = {
            "edl_forward": edl_fwd,
            "edl_train": edl_train,
            "torch_forward": torch_fwd,
            "torch_train": torch_train,
            "easydel_forward": easydel_fwd,
            "easydel_train": easydel_train,
        }
        rows.append(
            {
                "model": family,
                "layers": layers,
                "params": edl.count_params(model),
                **{f"{name}_s": seconds for name, seconds in times.items()},
                "forward_vs_torch": edl_fwd / torch_fwd,
                "train_vs_torch": edl_train / torch_train,
                "forward_vs_easydel": _ratio(edl_fwd, easydel_fwd),
                "train_vs_easydel": _ratio(edl_train, easydel_train),
                "edl_compile_s": compile_s,
                **_matmul_rates(config, batch * seq, seq, times, peak),
            }
        )
        print(f"{family} {layers} layers done", flush=True)
    config = _config("llama", layer_counts[0], args.quick)
    gemm = _gemm_ratio(batch * seq, config.hidden_size, config.intermediate_size, reps)
    print(f"one MLP GEMM alone, XLA/torch time: {gemm:.3g}")
    base_compile = rows[0]["edl_compile_s"]
    for row in rows:
        row["compile_vs_first"] = row["edl_compile_s"] / base_compile
    header = [
        "model",
        "layers",
        "params",
        "fwd edl/torch",
        "train edl/torch",
        "fwd edl/EasyDeL",
        "train edl/EasyDeL",
        "edl train ms",
        "torch train ms",
        "EasyDeL train ms",
        "compile s",
        "compile/first",
        "edl train / peak",
        "torch train / peak",
    ]
    keys = [
        "model",
        "layers",
        "params",
        "forward_vs_torch",
        "train_vs_torch",
        "forward_vs_easydel",
        "train_vs_easydel",
        "edl_train_s",
        "torch_train_s",
        "easydel_train_s",
        "edl_compile_s",
        "compile_vs_first",
        "edl_train_peak_fraction",
        "torch_train_peak_fraction",
    ]
    cells = [
        [r[key] * 1e3 if key.endswith("train_s") and r[key] else r[key] for key in keys]
        for r in rows
    ]
    print(table(header, cells))
    path = write_json(
        "model",
        rows,
        batch=batch,
        seq=seq,
        quick=args.quick,
        gemm_ratio=gemm,
        peak_gemm_flops_per_s=peak,
        targets=TARGETS,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
