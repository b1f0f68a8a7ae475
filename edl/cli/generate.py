"""``edl generate``: text from a saved model, checkpoint, run directory or hub model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

from edl._hub import is_repo_id
from edl.cli.checks import check_hub
from edl.cli.config import CommandError
from edl.cli.info import resolve_model
from edl.compile_cache import announce_compile
from edl.generate import generate, generate_text, stream_text
from edl.io.export import TOKENIZER_FILES, load_model
from edl.io.formats.hf import from_pretrained
from edl.text import ByteTokenizer
from edl.text.hf import HFTokenizer

__all__ = ["run_generate"]


def sample(model, prompt_ids, max_new_tokens: int, *, key=None, temperature: float = 0.0):
    """Extend ``prompt_ids`` (a list of ints) by ``max_new_tokens`` tokens, greedily
    (``temperature=0``) or by plain temperature sampling, with ``edl.generate`` (KV cache,
    one compiled decode loop)."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": None}
    out = generate(
        model,
        jnp.asarray([prompt_ids], jnp.int32),
        max_new_tokens=max_new_tokens,
        key=jax.random.key(0) if key is None else key,
        **(sampling if temperature > 0 else {}),
    )
    return [int(t) for t in out.sequences[0]]


def _tokenizer(where: str, has_files: bool, model: eqx.Module) -> HFTokenizer | ByteTokenizer:
    """The model directory's tokenizer (or the hub repo's), else the byte tokenizer."""
    if has_files:
        from edl.text import load_tokenizer

        try:
            return load_tokenizer(where)
        except ImportError as e:
            raise CommandError(f"{where} has tokenizer files, but {e}") from None
    # a vision-language model's (LLaVA, Gemma 3's gemma3): its language model's
    vocab = getattr(model.config, "text_config", model.config).vocab_size
    if vocab != ByteTokenizer.vocab_size:
        raise CommandError(
            f"{where} has no tokenizer files (tokenizer.json, ...), and its vocab_size {vocab} "
            f"is not the byte tokenizer's {ByteTokenizer.vocab_size}"
        )
    return ByteTokenizer()


def load_model_and_tokenizer(
    model: str, *, dtype: str | None = None
) -> tuple[eqx.Module, HFTokenizer | ByteTokenizer]:
    """The model behind ``--model`` (a run directory: its newest whole checkpoint; a
    checkpoint, LoRA-wrapped ones included; a saved model; a hub repo id) and its tokenizer."""
    cast = None if dtype is None else jnp.dtype(dtype)
    path = Path(model).expanduser()
    try:
        if not is_repo_id(model):
            directory = resolve_model(path)
            loaded = load_model(directory, dtype=cast)
            has_files = any((directory / n).is_file() for n in TOKENIZER_FILES)
            return loaded, _tokenizer(str(directory), has_files, loaded)
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    check_hub(model, "model", flag="--model")
    try:
        loaded = from_pretrained(model, dtype=cast)
        return loaded, _tokenizer(model, True, loaded)
    except CommandError:
        raise
    except Exception as e:  # the hub's errors: no such repo, offline, ...
        raise CommandError(
            f"{model} is no local path, and the hub could not serve it: {e}"
        ) from None


def run_generate(args: argparse.Namespace) -> None:
    """Stream the model's text for ``args`` (``edl generate``'s checked options) to stdout:
    a plain prompt followed by its continuation, or a chat reply alone; beam search prints
    at the end. stderr says when the decode loop compiles and how long the first token (or
    the beam search) took."""
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype)
    options = dict(
        chat=args.chat,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        key=jax.random.key(args.seed),
        kv_cache_dtype=args.kv_cache.kv_cache_dtype,
    )
    shown = "" if args.chat else args.prompt
    try:
        if args.num_beams > 1:
            with announce_compile(f"the beam search ({args.num_beams} beams, all of it)", _say):
                text = generate_text(
                    model, tokenizer, args.prompt, num_beams=args.num_beams, **options
                )
            print(shown + text, end="")
        else:
            pieces = stream_text(model, tokenizer, args.prompt, **options)
            # The first piece waits for the compile: said on stderr before the text starts.
            with announce_compile("the decode loop (and the first token)", _say):
                first = next(pieces, "")
            print(shown + first, end="", flush=True)
            for piece in pieces:
                print(piece, end="", flush=True)
    except ValueError as e:  # a chat without a template, an id the model lacks, ...
        raise CommandError(str(e)) from None
    print()


def _say(message: str) -> None:
    print(f"edl generate: {message}", file=sys.stderr, flush=True)
