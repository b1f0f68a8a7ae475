"""Peak memory of a LoRA SFT train step per precision setting: XLA's compiled memory
analysis and the measured process peak, each precision in a subprocess of its own.

Model: the shape of SmolLM2-135M-Instruct (Llama: hidden 576, intermediate 1536, 30 layers,
9 heads / 3 kv heads, head_dim 64, vocab 49152, tied embeddings) with random weights, built
directly in the parameter dtype (as ``edl train --param-dtype`` loads them); ``--quick``: 4
layers. LoRA rank 8, alpha 16 on q/k/v/o/gate/up/down (``apply_lora``'s default), AdamW,
``edl train``'s loss (``edl.cli.run.loss_fn``) and step options (``compute_dtype`` only where
it differs from the parameters'); batch 4 x 512 tokens: synthetic SFT examples packed by
``edl.train.TokenBatches`` (``benchmarks.finetune``'s data).

Precisions (``--precisions``):

- ``float32``: float32 parameters and compute;
- ``bf16``: bfloat16 parameters and compute (``--param-dtype bfloat16 --compute-dtype
  bfloat16``);
- ``mixed``: float32 parameters (and optimizer state), bfloat16 compute (``--compute-dtype
  bfloat16``).

Each child process builds the state and the step (``make_train_step``, jitted, state
donated), lowers and compiles it, reads ``memory_analysis()`` (argument, output, temp and
alias bytes: XLA's own plan, deterministic), runs ``--steps`` steps and reads the process's
peak resident memory (``VmHWM`` of ``/proc/self/status``, else ``ru_maxrss``): everything the
process held at its worst moment, Python and jax's runtime included. One process per
precision, so no peak hides another. The table gives both, each precision's ratio to
float32's, and the resident memory when the first step starts (the process's own share:
Python, jax's runtime and what compiling left, with the train state and batches).

    python -m benchmarks.memory [--quick] [--steps 3] [--precisions float32,bf16,mixed]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = {
    "float32": ("float32", None),
    "bf16": ("bfloat16", None),
    "mixed": ("float32", "bfloat16"),
}
"""name -> (parameter dtype, compute dtype or None: the parameters')."""

MIB = 2**20


def _config(quick: bool):
    from edl.models import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4 if quick else 30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def peak_rss_mib() -> float:
    """The process's peak resident memory so far (MiB): ``VmHWM``, else ``ru_maxrss``."""
    return _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(field: str) -> float | None:
    """A ``/proc/self/status`` memory field in MiB (None off Linux)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    return None


def measure(precision: str, *, quick: bool, steps: int, batch: int, seq: int) -> dict:
    """One precision's numbers (run in a child process: ``--child``)."""
    import jax
    import jax.numpy as jnp
    import optax

    import edl
    from benchmarks.finetune import _batches
    from edl.cli.run import loss_fn
    from edl.lora import apply_lora, lora_trainable
    from edl.models import LlamaForCausalLM
    from edl.train import make_train_step

    param_dtype, compute_dtype = PRECISIONS[precision]
    config = _config(quick)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0), dtype=jnp.dtype(param_dtype))
    model = apply_lora(model, rank=8, alpha=16, key=jax.random.key(1))
    tx = optax.adamw(1e-4, weight_decay=0.01)
    state = edl.create_state(model, tx, trainable=lora_trainable)
    del model
    keys = ("input_ids", "labels", "segment_ids", "position_ids")
    data = [{k: jnp.asarray(b[k]) for k in keys} for b in _batches(config, batch, seq, steps)]
    step = make_train_step(loss_fn, tx, compute_dtype=compute_dtype)
    start = time.perf_counter()
    compiled = step.lower(state, data[0]).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    before_steps = peak_rss_mib()
    resident = _status_mib("VmRSS")  # what the process holds when the first step starts
    seconds = []
    for b in data:
        start = time.perf_counter()
        state, metrics = compiled(state, b)
        jax.block_until_ready(metrics["loss"])
        seconds.append(time.perf_counter() - start)
    xla = {
        name: getattr(analysis, f"{name}_size_in_bytes") / MIB
        for name in ("argument", "output", "temp", "alias")
    }
    return {
        "precision": precision,
        "param_dtype": param_dtype,
        "compute_dtype": compute_dtype or param_dtype,
        "layers": config.num_hidden_layers,
        "tokens": batch * seq,
        "xla_mib": xla,
        # What the step holds at once: its arguments (outputs alias the donated state) and
        # its temporaries.
        "xla_peak_mib": xla["argument"] + xla["output"] - xla["alias"] + xla["temp"],
        "rss_peak_mib": peak_rss_mib(),
        "rss_peak_before_steps_mib": before_steps,
        "rss_at_first_step_mib": resident,
        "compile_s": compile_s,
        "step_s": sorted(seconds)[len(seconds) // 2],
        "final_loss": float(metrics["loss"]),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }


def _child(precision: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", precision]
    cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--quick"] if args.quick else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"benchmarks.memory: {precision} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: list[dict]) -> str:
    base = next((r for r in results if r["precision"] == "float32"), None)
    rows = [
        "| precision | params / compute | XLA temp MiB | XLA peak MiB | process peak MiB "
        "| vs float32 (XLA / process) | resident at step 1 MiB | step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = "-"
        if base is not None:
            ratio = (
                f"{r['xla_peak_mib'] / base['xla_peak_mib']:.2f} / "
                f"{r['rss_peak_mib'] / base['rss_peak_mib']:.2f}"
            )
        rows.append(
            f"| {r['precision']} | {r['param_dtype']} / {r['compute_dtype']} "
            f"| {r['xla_mib']['temp']:.0f} | {r['xla_peak_mib']:.0f} | {r['rss_peak_mib']:.0f} "
            f"| {ratio} | {r['rss_at_first_step_mib'] or 0:.0f} | {r['step_s']:.2f} |"
        )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated, of {', '.join(PRECISIONS)} (default: all)",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps run after compiling (3)")
    parser.add_argument("--batch", type=int, default=4, help="rows per batch (4)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row (512)")
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 30")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--child",
        choices=sorted(PRECISIONS),
        help="internal: measure one precision in this process (the parent runs one per child)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        result = measure(
            args.child, quick=args.quick, steps=args.steps, batch=args.batch, seq=args.seq
        )
        print(json.dumps(result))
        return
    names = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(names) - set(PRECISIONS))
    if unknown:
        parser.error(f"--precisions: unknown {unknown}; choose from {', '.join(PRECISIONS)}")
    results = []
    for name in names:
        results.append(_child(name, args))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
