"""Sections 4-6 on a ~1B Llama (Llama-3.2-1B's shape, random weights): the train step
(tokens/s, MFU, per remat policy), ``edl.generate.generate`` (new tokens/s by batch) and
``edl.serve.engine.Engine`` (output tokens/s and time to first token at 64 requests at
once, through the Python API). The dry run: a tiny Llama on the CPU, same code paths.

The train step is ``benchmarks/train.py``'s own measurement (``_measure``: AdamW,
clipping, chunked loss, donation, ahead-of-time compile timed apart; MFU = tokens/s *
``edl.models.flops_per_token`` / peak), run once per remat policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.device.common import (
    CPU_PEAK_TFLOPS,
    H100_BF16_PEAK_TFLOPS,
    Deadline,
    Sink,
    is_oom,
    percentile,
    short_error,
    skip_note,
)

# The dry run's stand-in for the 1B model: the same code paths, seconds of compile on CPU.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """The model and the sizes of sections 4-6."""

    fields: dict[str, Any]  # LlamaConfig fields
    dtype: str
    peak_tflops: float
    attention_impl: str  # the train step's edl.ops.attention impl
    remats: tuple[str, ...]
    train_batch: int
    train_seq: int
    train_steps: int
    decode: tuple[tuple[int, bool], ...]  # (batch, unstack_layers), in order
    prompt: int
    new_tokens: int
    decode_repeats: int
    requests: int  # serving: all at once, max_batch = requests
    page_size: int
    serve_impls: tuple[str, ...]  # the engine's attention impl, then fallbacks


def _one_b() -> dict[str, Any]:
    """Llama-3.2-1B's shape as ``benchmarks/train.py`` defines it, without its remat (a run
    option: ``LlamaConfig`` takes it inside ``run=RunOptions(...)``)."""
    from benchmarks.train import CONFIGS

    return {k: v for k, v in CONFIGS["1b"][0].items() if k != "remat"}


def shapes_for(dry: bool) -> ModelShapes:
    """The GPU run's sizes (8 x 2048 tokens per step fits 80 GB without remat: ~10 GB of
    bf16 weights, gradients and AdamW moments, ~30 GB of activations), or the dry run's."""
    if dry:
        return ModelShapes(
            fields=TINY,
            dtype="float32",
            peak_tflops=CPU_PEAK_TFLOPS,
            attention_impl="xla",
            remats=("none", "dots", "full"),
            train_batch=2,
            train_seq=128,
            train_steps=2,
            decode=((1, False), (2, False)),
            prompt=16,
            new_tokens=8,
            decode_repeats=1,
            requests=4,
            page_size=8,
            serve_impls=("auto",),
        )
    return ModelShapes(
        fields=_one_b(),
        dtype="bfloat16",
        peak_tflops=H100_BF16_PEAK_TFLOPS,
        attention_impl="pallas",
        remats=("none", "dots", "full"),
        train_batch=8,
        train_seq=2048,
        train_steps=5,
        decode=((1, False), (8, False), (64, False), (1, True)),
        prompt=128,
        new_tokens=128,
        decode_repeats=3,
        requests=64,
        page_size=16,
        serve_impls=("auto", "xla"),
    )


def _number(value: float) -> float:
    """``value``, or -1 for NaN (for picking a best row)."""
    return -1.0 if value != value else value


def _free() -> None:
    """Free the device memory of dead arrays (a failed step's state) before the next try."""
    gc.collect()


def _train_once(shapes: ModelShapes, remat: str, batch: int) -> dict[str, Any]:
    """``benchmarks.train._measure`` at this remat policy and batch (registered as a config
    of that module under a name of its own)."""
    import jax.numpy as jnp

    from benchmarks import train
    from edl.models.config import RunOptions

    name = f"device-{remat}-{batch}"
    run = RunOptions(remat=remat, attention_impl=shapes.attention_impl)
    fields = {**shapes.fields, "run": run}
    train.CONFIGS[name] = (fields, batch, shapes.train_seq)
    return train._measure(
        name, jnp.dtype(shapes.dtype), shapes.train_steps, shapes.peak_tflops * 1e12
    )


def _train_row(shapes: ModelShapes, remat: str) -> dict[str, Any]:
    """One remat policy's row; out of memory at the planned batch retries once at half."""
    row: dict[str, Any] = {"remat": remat, "attention_impl": shapes.attention_impl}
    batch = shapes.train_batch
    while True:
        try:
            result = _train_once(shapes, remat, batch)
        except Exception as err:
            error, oom = short_error(err), is_oom(err)
        else:
            row |= result
            row["flops_per_token"] = row["tflops"] * 1e12 / row["tokens_per_s"]
            return row
        _free()  # out of the except block: its traceback held the failed try's arrays
        if not oom or batch == 1 or "oom_at_batch" in row:
            nan = float("nan")
            return row | {
                "batch": batch,
                "seq": shapes.train_seq,
                "error": error,
                "tokens_per_s": nan,
                "mfu": nan,
                "step_ms": nan,
            }
        row["oom_at_batch"], batch = batch, batch // 2


def _rows_in_time(
    sink: Sink,
    items: Sequence[Any],
    measure: Callable[[Any], dict[str, Any]],
    deadline: Deadline,
    headline: Callable[[list[dict[str, Any]]], str],
    factor: float = 1.2,
    label: Callable[[Any], str] = str,
) -> None:
    """``sink.row(measure(item))`` for each item, the headline updated after each, while the
    next item's likely time (``factor`` x the slowest so far) fits the deadline; the items
    left are noted in ``meta["skipped"]``."""
    need = 0.0
    for i, item in enumerate(items):
        if not deadline.allows(need):
            sink.set(skipped=[skip_note(label(rest), need, deadline) for rest in items[i:]])
            return
        start = time.perf_counter()
        sink.row(measure(item))
        sink.set(headline=headline(sink.rows))
        need = max(need, factor * (time.perf_counter() - start))


def run_train(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 4: train-step tokens/s and MFU for each remat policy."""
    shapes = shapes_for(dry)
    sink.set(
        model=shapes.fields,
        dtype=shapes.dtype,
        peak_tflops=shapes.peak_tflops,
        mfu="tokens/s * flops_per_token (6N + attention, edl.models) / peak",
        steps=shapes.train_steps,
    )

    def measure(remat: str) -> dict[str, Any]:
        row = _train_row(shapes, remat)
        _free()
        return row

    def headline(rows: list[dict[str, Any]]) -> str:
        best = max(rows, key=lambda r: _number(r["tokens_per_s"]))
        return (
            f"best remat {best['remat']}: {best['tokens_per_s']:.4g} tok/s, "
            f"MFU {best['mfu']:.3g} (peak {shapes.peak_tflops} TF/s)"
        )

    _rows_in_time(
        sink, shapes.remats, measure, deadline, headline, label=lambda remat: f"remat {remat}"
    )


def _model(shapes: ModelShapes) -> Any:
    """The random-weight Llama in ``shapes.dtype``."""
    import jax
    import jax.numpy as jnp

    import edl
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shapes.fields, max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    return edl.module.to_dtype(model, jnp.dtype(shapes.dtype))


def _decode_row(model: Any, batch: int, unstack: bool, shapes: ModelShapes) -> dict[str, Any]:
    """``generate``'s new tokens/s at ``batch`` (prefill included), after a first call that
    compiles; every row must produce all its tokens (no EOS set)."""
    import jax

    from edl.generate import GenerationConfig, generate

    rng = np.random.default_rng(batch)
    ids = rng.integers(0, model.config.vocab_size, (batch, shapes.prompt)).astype(np.int32)
    config = GenerationConfig(max_new_tokens=shapes.new_tokens)  # greedy, no EOS

    def call():
        return generate(model, ids, config=config, unstack_layers=unstack)

    start = time.perf_counter()
    out = jax.block_until_ready(call())
    first = time.perf_counter() - start
    if not bool(np.all(np.asarray(out.num_new) == shapes.new_tokens)):
        raise RuntimeError(f"generate stopped early: num_new {np.asarray(out.num_new)}")
    samples = []
    for _ in range(shapes.decode_repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    return {
        "batch": batch,
        "unstack_layers": unstack,
        "prompt": shapes.prompt,
        "new_tokens": shapes.new_tokens,
        "first_call_s": first,
        "seconds": seconds,
        "tokens_per_s": batch * shapes.new_tokens / seconds,
        "ms_per_step": seconds / shapes.new_tokens * 1e3,
    }


def run_decode(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 5: ``generate`` new tokens/s at each batch (bf16, random weights)."""
    shapes = shapes_for(dry)
    start = time.perf_counter()
    model = _model(shapes)
    sink.set(
        model=shapes.fields,
        dtype=shapes.dtype,
        model_init_s=time.perf_counter() - start,
        note="tokens/s = batch * new_tokens / one generate call (prefill included), "
        f"median of {shapes.decode_repeats} after a compiling call",
    )

    def measure(setting: tuple[int, bool]) -> dict[str, Any]:
        batch, unstack = setting
        try:
            return _decode_row(model, batch, unstack, shapes)
        except Exception as err:
            return {
                "batch": batch,
                "unstack_layers": unstack,
                "tokens_per_s": float("nan"),
                "error": short_error(err),
            }

    def headline(rows: list[dict[str, Any]]) -> str:
        return ", ".join(
            f"b{r['batch']}{'/unstacked' if r['unstack_layers'] else ''} "
            f"{r['tokens_per_s']:.4g} tok/s"
            for r in rows
        )

    _rows_in_time(
        sink,
        shapes.decode,
        measure,
        deadline,
        headline,
        label=lambda s: f"batch {s[0]}{' unstacked' if s[1] else ''}",
    )


def _serve_pass(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Add every prompt at once, step until all finish; throughput and latencies."""
    from edl.serve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    first: dict[int, float] = {}
    steps, tokens = [], 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - t0)
        for o in outputs:
            tokens += len(o.new_token_ids)
            first.setdefault(o.request_id, now - start)
    wall = time.perf_counter() - start
    ttft = list(first.values())
    return {
        "seconds": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "step_p50_ms": percentile(steps, 50) * 1e3,
        "steps": len(steps),
    }


def _compiled_shapes() -> int | None:
    """How many programs ``edl.serve.step.model_step`` has compiled (None if unknown)."""
    from edl.serve.step import model_step

    with contextlib.suppress(Exception):
        return int(model_step._cache_size())
    return None


def _serve_row(model: Any, impl: str, shapes: ModelShapes) -> dict[str, Any]:
    """One engine with attention ``impl``: a warm-up pass of the workload (compiles every
    step shape it uses, timed apart), then the timed pass of fresh prompts."""
    from edl.models import configure
    from edl.serve.engine import Engine

    n, max_tokens = shapes.requests, shapes.new_tokens
    engine = Engine(
        configure(model, attention_impl=impl),
        max_batch=n,
        max_model_len=shapes.prompt + max_tokens,
        page_size=shapes.page_size,
        prefill_chunk=shapes.prompt,
        prefill_tokens=n * shapes.prompt,
        prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def prompts() -> list[list[int]]:
        return rng.integers(0, vocab, (n, shapes.prompt)).tolist()

    start = time.perf_counter()
    _serve_pass(engine, prompts(), max_tokens)
    warmup, compiled = time.perf_counter() - start, _compiled_shapes()
    row = {
        "impl": impl,
        "requests": n,
        "prompt": shapes.prompt,
        "max_tokens": max_tokens,
        "warmup_s": warmup,
        "compiled_shapes": compiled,
    }
    row |= _serve_pass(engine, prompts(), max_tokens)
    row["recompiled"] = None if compiled is None else _compiled_shapes() != compiled
    if row["output_tokens"] != n * max_tokens:
        raise RuntimeError(f"engine produced {row['output_tokens']} tokens, not {n * max_tokens}")
    return row


def run_serve(sink: Sink, *, dry: bool, deadline: Deadline, out: Path) -> None:
    """Section 6: ``Engine`` output tokens/s and TTFT, all requests added at once; on an
    error the next attention impl of ``serve_impls`` is tried."""
    shapes = shapes_for(dry)
    model = _model(shapes)
    sink.set(
        model=shapes.fields,
        dtype=shapes.dtype,
        page_size=shapes.page_size,
        note="all requests added at once (max_batch = requests, one prefill call); "
        "TTFT from add_request; warm-up = one untimed pass of the same workload",
    )
    for impl in shapes.serve_impls:
        try:
            row = _serve_row(model, impl, shapes)
        except Exception as err:
            row = {"impl": impl, "tokens_per_s": float("nan"), "error": short_error(err)}
        if "error" in row:
            sink.row(row)
            _free()  # the failed engine's cache pools
            continue
        sink.row(row)
        sink.set(
            headline=f"{impl}: {row['tokens_per_s']:.4g} tok/s, TTFT p50 "
            f"{row['ttft_p50_s']:.3g} s, warm-up {row['warmup_s']:.3g} s"
        )
        return
    sink.set(headline="every impl failed")
