"""``edl serve``: a model behind the OpenAI-compatible HTTP server (:mod:`edl.serve.server`),
batched by ``edl.serve.engine.Engine`` (continuous batching over a paged KV cache) with the
model's EOS ids; ``--warmup`` compiles the engine's step shapes before it listens (with a
Hugging Face tokenizer, each shape's grammar-masked program for structured output too).

It says what it does on stderr from its first second, each line with the seconds since
start: loading the model, building the engine (how many step shapes, where the compilation
cache is), each shape ``--warmup`` compiles with the time so far and an estimate of the time
left, and, while serving, each step shape a request is first to need (it waits on that
compile)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from edl.cli.config import CommandError
from edl.serve.options import API_KEY_ENV, ServerOptions, is_loopback

__all__ = ["run_serve", "stderr_log", "warn_if_exposed"]

# Seconds open requests get to finish after SIGTERM before they are aborted.
DRAIN_S = 30.0


def stderr_log(start: float) -> Callable[[str], None]:
    """A function printing ``edl serve [  12.3 s]: message`` lines to stderr, the seconds
    counted from ``start`` (a ``time.perf_counter()`` value)."""

    def say(message: str) -> None:
        print(
            f"edl serve [{time.perf_counter() - start:6.1f} s]: {message}",
            file=sys.stderr,
            flush=True,
        )

    return say


def warn_if_exposed(host: str, options: ServerOptions, say: Callable[[str], None]) -> None:
    """A warning line when the server listens beyond this machine with no API key."""
    if options.api_key is None and not is_loopback(host):
        say(
            f"WARNING: --host {host} is not a loopback address and no API key is set "
            f"(--api-key or ${API_KEY_ENV}): anyone who can reach this port can use the model"
        )


def _engine(args, model, tokenizer, eos, max_model_len, draft_model, say):
    """The serving engine of ``args``' options; its refusals (``ValueError``, naming what
    and why) become one ``CommandError`` line, no traceback."""
    from edl.serve.engine import Engine
    from edl.text import HFTokenizer

    try:
        return Engine(
            model,
            max_batch=args.max_batch,
            max_model_len=max_model_len,
            eos_token_ids=eos,
            echo=say,
            # structured output / forced tool calls mask tokens by the HF tokenizer's vocabulary
            tokenizer=tokenizer if isinstance(tokenizer, HFTokenizer) else None,
            speculative=args.speculative,
            draft_model=draft_model,
            kv_cache_dtype=args.kv_cache.kv_cache_dtype,
        )
    except ValueError as e:
        raise CommandError(f"the serving engine refuses this model or these options: {e}") from None


def run_serve(args: argparse.Namespace) -> None:
    """Load ``args.model`` and its tokenizer, build the engine and serve until SIGTERM."""
    say = stderr_log(time.perf_counter())
    say(f"loading {args.model} ...")
    try:
        from edl.serve.server import create_app, serve
    except ImportError as e:
        raise CommandError(
            f"edl serve needs the serve extra (pip install 'edl-jax[serve]'): {e}"
        ) from None
    import jax

    from edl.cli.generate import load_model_and_tokenizer
    from edl.generate import GenerationConfig
    from edl.module import count_params
    from edl.serve.multimodal import text_model

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    params = count_params(model)
    if (lm := text_model(model)) is not model:
        say("a vision-language model: serving its language model, text only (no image parts)")
        model = lm
    max_model_len = args.max_model_len or model.config.max_position_embeddings
    eos = GenerationConfig.of_model(model).eos_ids
    if not eos and getattr(tokenizer, "eos_id", None) is not None:
        eos = (int(tokenizer.eos_id),)
    draft_model = None
    if args.draft_model is not None:
        say(f"loading the draft model {args.draft_model} ...")
        draft_model, _ = load_model_and_tokenizer(args.draft_model, dtype=args.dtype)
    say(f"loaded {params:,} parameters; building the engine ...")
    from edl.text import HFTokenizer

    engine = _engine(args, model, tokenizer, eos, max_model_len, draft_model, say)
    cache = jax.config.jax_compilation_cache_dir
    shapes = len(engine.step_shapes())
    masked = " x2 (plain, grammar-masked)" if isinstance(tokenizer, HFTokenizer) else ""
    say(
        f"engine ready: {shapes} step shapes{masked} (batch rows {engine.row_buckets}, prefill "
        f"widths {engine.width_buckets}, pages {engine.page_buckets}); compilation cache: "
        f"{cache or 'off'}"
    )
    if args.speculative is not None:
        spec = args.speculative
        say(
            f"speculative decoding: {spec.method}"
            + ("" if draft_model is None else f" ({count_params(draft_model):,} parameters)")
            + f", up to {spec.num_speculative_tokens} draft "
            f"tokens per request and step, verified in calls of width "
            f"{spec.num_speculative_tokens + 1} (counted in the step shapes)"
        )
    if args.warmup:
        programs = len(engine.step_programs())  # each shape with and without log-probs
        say(
            f"compiling {programs} step programs ({shapes} shapes, log-probs off and on; "
            "--warmup) ..."
        )
        engine.warmup()
    else:
        say("each step shape compiles when a request first needs it (--warmup: all now)")
    app = create_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or args.model,
        max_model_len=max_model_len,
        stop_token_ids=eos,
        options=args.options,
    )
    warn_if_exposed(args.host, args.options, say)
    say(f"starting the HTTP server on http://{args.host}:{args.port}")
    serve(app, host=args.host, port=args.port, drain_s=DRAIN_S)
