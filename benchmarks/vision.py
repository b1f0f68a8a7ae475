"""CLIP (and SigLIP) image embeddings: images/s of ``get_image_features``, edl vs
transformers + torch, same weights, side by side.

Models (random weights, float32, real sizes):

- ``clip-b32`` / ``clip-b16``: transformers' ``CLIPConfig()`` defaults (ViT-B: image 224,
  hidden 768, 12 layers, 12 heads, MLP 3072, ``quick_gelu``, projection 512) with patch 32
  (50 tokens) or 16 (197 tokens), ``--patch``; timed: ``CLIPModel.get_image_features``, the
  vision tower and ``visual_projection``.
- ``siglip-b16`` (``--siglip``): ``SiglipVisionConfig()`` defaults (image 224, patch 16: 196
  tokens, hidden 768, 12 layers, ``gelu_pytorch_tanh``); timed: ``SiglipVisionModel``'s
  ``pooler_output`` (the attention-pooling head), which is ``SiglipModel.get_image_features``.

Both sides run identical weights: the model is built in transformers (``torch.manual_seed``),
``save_pretrained`` to a temporary directory and loaded by ``edl.from_pretrained``, once per
edl attention implementation in ``--impls`` (``run.attention_impl``: ``"auto"`` is the Pallas
flash kernel, interpreted on CPU; ``"xla"`` the plain-XLA path). Before timing, the script
prints each edl variant's max abs difference from torch's embeddings on the same pixels and
stops if one exceeds ``TOLERANCE``.

edl: one ``jax.jit`` of ``model, pixels -> embeddings``, compiled ahead from a cold cache
(``jax.clear_caches()``, then ``lower().compile()``: "compile s"), run once untimed,
``block_until_ready``. torch: ``torch.inference_mode()``, ``torch.set_num_threads(
os.cpu_count())``, its default (SDPA) attention. Beside them, the tower's fc1 GEMM alone
(``(batch * tokens, hidden) @ (hidden, intermediate)``, XLA and torch) runs in the same rounds:
the backends' matmul floor at that row count ("fc1 GEMM xla/torch time").

Timing: ``--rounds`` rounds; in each round every variant runs once (a sample repeats a call
about ``SAMPLE_S`` / its time times), the order reversed every other round; where every
variant's call is under ``WARM_BELOW_S`` each timed sample is preceded by an untimed one
(``interleaved_rounds(warm_each=True)``: this VM runs work after an idle gap or right after
torch's spinning OpenMP workers slower for its first ~100 ms). images/s are medians over
rounds; "edl/torch" is the median of the per-round ratios of images/s (> 1: edl faster).
On a busy machine torch's OpenMP threads lose far more than XLA's (see RESULTS.md): print
the load average and compare only quiet runs. The full set (``--patch 32 16 --siglip``)
takes ~13 minutes on the quiet 2-core VM; the default (B/32) ~4.

    python -m benchmarks.vision [--quick] [--batch-sizes 1 8 32] [--patch 32 16] [--siglip]
                                [--impls auto xla] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import edl
from benchmarks._common import interleaved_rounds, table, write_json

TOLERANCE = 1e-3  # max abs difference of the embeddings (|values| ~ 1): float32 op-order noise
SAMPLE_S = 0.5  # a timed sample repeats short calls until it lasts about this long
WARM_BELOW_S = 1.0  # calls shorter than this get an untimed call right before the timed one


def _hf_model(family: str, patch: int, quick: bool):
    """A transformers model with random weights (eval mode) and its embedding function."""
    import torch
    import transformers

    small = (
        {
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        if quick
        else {}
    )
    torch.manual_seed(0)
    if family == "clip":
        text = small if quick else {}  # the text tower is not timed; small in --quick
        config = transformers.CLIPConfig(
            text_config=text, vision_config={"patch_size": patch, **small}
        )
        model = transformers.CLIPModel(config).eval()

        def embed(pixels):
            return model.get_image_features(pixel_values=pixels).pooler_output

    else:
        config = transformers.SiglipVisionConfig(patch_size=patch, **small)
        model = transformers.SiglipVisionModel(config).eval()

        def embed(pixels):
            return model(pixel_values=pixels).pooler_output

    return model, embed


def _edl_embed(family: str) -> Callable[[Any, jax.Array], jax.Array]:
    if family == "clip":
        return jax.jit(lambda model, pixels: model.get_image_features(pixels))
    return jax.jit(lambda model, pixels: model(pixels).pooler_output)


def _repeat(call: Callable[[], Any], n: int) -> Callable[[], Any]:
    def run():
        for _ in range(n):
            out = call()
        return out

    return run


def _check(name, embed, edl_models, torch_embed, pixels: np.ndarray) -> dict[str, float]:
    """Each edl variant's max abs difference from torch's embeddings of ``pixels``; raises
    above ``TOLERANCE``."""
    import torch

    with torch.inference_mode():
        want = torch_embed(torch.from_numpy(pixels)).numpy()
    diffs = {}
    for impl, model in edl_models.items():
        got = np.asarray(embed(model, jnp.asarray(pixels)))
        diffs[impl] = float(np.max(np.abs(got - want)))
        print(
            f"{name} edl[{impl}] vs torch: max abs diff {diffs[impl]:.3g} "
            f"(max |torch| {np.max(np.abs(want)):.3g})",
            flush=True,
        )
        if not diffs[impl] <= TOLERANCE:
            raise AssertionError(
                f"{name}: edl[{impl}] embeddings differ from torch's by {diffs[impl]:.3g} "
                f"> {TOLERANCE}"
            )
    return diffs


def _gemm_calls(rows: int, dim: int, hidden: int) -> dict[str, Callable[[], Any]]:
    """The tower's fc1 GEMM alone (``x @ W.T``, torch's weight layout), XLA and torch: the
    backends' matmul floor at this batch's token count."""
    import torch

    rng = np.random.default_rng(1)
    x = rng.normal(size=(rows, dim)).astype(np.float32)
    w = rng.normal(size=(hidden, dim)).astype(np.float32)
    xj, wj, xt, wt = jnp.asarray(x), jnp.asarray(w), torch.from_numpy(x), torch.from_numpy(w)
    mm = jax.jit(lambda x, w: jnp.einsum("ti,oi->to", x, w))
    return {
        "gemm xla": lambda: mm(xj, wj),
        "gemm torch": lambda: torch.nn.functional.linear(xt, wt),
    }


def _interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, ``rounds`` samples each: see the docstring."""
    single = {}
    for key, call in calls.items():  # first calls, untimed; then one to size the samples
        jax.block_until_ready(call())
        start = time.perf_counter()
        jax.block_until_ready(call())
        single[key] = time.perf_counter() - start
    repeats = {k: max(1, round(SAMPLE_S / t)) for k, t in single.items()}
    warm = max(single.values()) < WARM_BELOW_S
    timed = {k: _repeat(c, repeats[k]) for k, c in calls.items()}
    samples = {k: [] for k in calls}
    for r in range(rounds):
        order = list(timed) if r % 2 == 0 else list(reversed(timed))
        got = interleaved_rounds({k: timed[k] for k in order}, 1, warm_each=warm)
        for k in calls:
            samples[k].append(got[k][0] / repeats[k])
    return samples


def _embed_calls(embed, edl_models, torch_embed, pixels: np.ndarray):
    """``({variant: call}, {impl: compile seconds})``: each edl variant compiled ahead
    (trace + lower + compile) on ``pixels``, and torch under ``inference_mode``."""
    import torch

    x_jax, x_torch = jnp.asarray(pixels), torch.from_numpy(pixels)
    calls, compile_s = {}, {}
    for impl, model in edl_models.items():
        jax.clear_caches()  # a cold compile: the agreement check compiled batch 2 already
        start = time.perf_counter()
        compiled = embed.lower(model, x_jax).compile()
        compile_s[impl] = time.perf_counter() - start
        calls[f"edl {impl}"] = lambda c=compiled, m=model: c(m, x_jax)

    def torch_call():
        with torch.inference_mode():
            return torch_embed(x_torch)

    calls["torch"] = torch_call
    return calls, compile_s


def _bench_model(family, patch, args) -> list[dict[str, Any]]:
    """Every batch size of one model: agreement check, compile, interleaved timing."""
    name = f"{family}-b{patch}"
    hf, torch_embed = _hf_model(family, patch, args.quick)
    vision = hf.config.vision_config if family == "clip" else hf.config
    image, tokens = vision.image_size, (vision.image_size // patch) ** 2 + int(family == "clip")
    print(
        f"{name}: {sum(p.numel() for p in hf.parameters()):,} params in the transformers "
        f"model, torch attention {hf.config._attn_implementation!r}",
        flush=True,
    )
    edl_models = {}
    with tempfile.TemporaryDirectory(prefix="edl-vision-") as tmp:
        hf.save_pretrained(tmp)
        for impl in args.impls:
            edl_models[impl] = edl.from_pretrained(tmp, attention_impl=impl)
    embed = _edl_embed(family)
    rng = np.random.default_rng(0)
    # Same pixels on both sides; a batch of 2, so rows mixing would show.
    diffs = _check(
        name,
        embed,
        edl_models,
        torch_embed,
        rng.normal(size=(2, 3, image, image)).astype(np.float32),
    )
    rows = []
    for batch in args.batch_sizes:
        pixels = rng.normal(size=(batch, 3, image, image)).astype(np.float32)
        calls, compile_s = _embed_calls(embed, edl_models, torch_embed, pixels)
        calls.update(_gemm_calls(batch * tokens, vision.hidden_size, vision.intermediate_size))
        samples = _interleaved(calls, args.rounds)
        rate = {k: [batch / s for s in v] for k, v in samples.items()}
        gemm = statistics.median(
            x / t for x, t in zip(samples["gemm xla"], samples["gemm torch"], strict=True)
        )
        for impl in edl_models:
            ratios = [e / t for e, t in zip(rate[f"edl {impl}"], rate["torch"], strict=True)]
            rows.append(
                {
                    "model": name,
                    "tokens": tokens,
                    "batch": batch,
                    "edl_attention_impl": impl,
                    "edl_images_per_s": statistics.median(rate[f"edl {impl}"]),
                    "torch_images_per_s": statistics.median(rate["torch"]),
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "edl_best_images_per_s": max(rate[f"edl {impl}"]),
                    "torch_best_images_per_s": max(rate["torch"]),
                    "edl_compile_s": compile_s[impl],
                    "max_abs_diff": diffs[impl],
                    "fc1_gemm_xla_over_torch_time": gemm,
                    "edl_rates": rate[f"edl {impl}"],
                    "torch_rates": rate["torch"],
                }
            )
        print(f"{name} batch {batch} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2-layer hidden-128 towers, batches 1 and 4, 2 rounds"
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="images per call (1 8 32)"
    )
    parser.add_argument(
        "--patch",
        type=int,
        nargs="+",
        default=[32],
        help="CLIP patch sizes: 32 (B/32, 50 tokens), 16 (B/16, 197)",
    )
    parser.add_argument("--siglip", action="store_true", help="also SigLIP base (patch 16)")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["auto", "xla"],
        help="edl run.attention_impl values, each a variant",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (5; quick 2)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    args.batch_sizes = args.batch_sizes or ([1, 4] if args.quick else [1, 8, 32])
    args.rounds = args.rounds or (2 if args.quick else 5)
    print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    runs = [("clip", p) for p in args.patch] + ([("siglip", 16)] if args.siglip else [])
    rows = [row for family, patch in runs for row in _bench_model(family, patch, args)]
    print(
        f"float32; {args.rounds} rounds; jax {jax.__version__} ({jax.default_backend()}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
        f"{transformers.__version__}"
    )
    print(
        table(
            [
                "model",
                "tokens",
                "batch",
                "edl attn",
                "edl img/s",
                "torch img/s",
                "edl/torch",
                "range",
                "best: edl / torch",
                "fc1 GEMM xla/torch time",
                "edl compile s",
                "max abs diff",
            ],
            [
                [
                    r["model"],
                    r["tokens"],
                    r["batch"],
                    r["edl_attention_impl"],
                    r["edl_images_per_s"],
                    r["torch_images_per_s"],
                    r["ratio"],
                    f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                    f"{r['edl_best_images_per_s']:.4g} / {r['torch_best_images_per_s']:.4g}",
                    r["fc1_gemm_xla_over_torch_time"],
                    r["edl_compile_s"],
                    f"{r['max_abs_diff']:.2g}",
                ]
                for r in rows
            ],
        )
    )
    path = write_json(
        "vision",
        rows,
        quick=args.quick,
        rounds=args.rounds,
        dtype="float32",
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
        load_average=os.getloadavg(),
    )
    print(f"load average {os.getloadavg()[0]:.2f} at the end; wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
