"""``edl serve``: a model behind the OpenAI-compatible HTTP server (:mod:`edl.serve.server`),
batched by ``edl.serve.engine.Engine`` (continuous batching over a paged KV cache) with the
model's EOS ids; ``--warmup`` compiles the engine's step shapes before it listens."""

from __future__ import annotations

import argparse

from edl.cli.config import CommandError

__all__ = ["run_serve"]

# Seconds open requests get to finish after SIGTERM before they are aborted.
DRAIN_S = 30.0


def run_serve(args: argparse.Namespace) -> None:
    """Load ``args.model`` and its tokenizer, build the engine and serve until SIGTERM."""
    try:
        from edl.serve.server import create_app, serve
    except ImportError as e:
        raise CommandError(
            f"edl serve needs the serve extra (pip install 'edl-jax[serve]'): {e}"
        ) from None
    from edl.cli.generate import load_model_and_tokenizer
    from edl.generate import GenerationConfig

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    max_model_len = args.max_model_len or model.config.max_position_embeddings
    eos = GenerationConfig.of_model(model).eos_ids
    if not eos and getattr(tokenizer, "eos_id", None) is not None:
        eos = (int(tokenizer.eos_id),)
    from edl.serve.engine import Engine

    engine = Engine(model, max_batch=args.max_batch, max_model_len=max_model_len, eos_token_ids=eos)
    if args.warmup:
        print(f"edl serve: compiling {len(engine.step_shapes())} step shapes", flush=True)
        engine.warmup()
    app = create_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or args.model,
        max_model_len=max_model_len,
        stop_token_ids=eos,
    )
    serve(app, host=args.host, port=args.port, drain_s=DRAIN_S)
