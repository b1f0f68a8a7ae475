"""``edl generate``: continue a prompt with a saved byte-level model."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

import edl
from edl.cli.info import resolve_model
from edl.generate import generate
from edl.train import ByteTokenizer

__all__ = ["run_generate", "sample"]


def sample(model, prompt_ids, max_new_tokens: int, *, key=None, temperature: float = 0.0):
    """Extend ``prompt_ids`` (a list of ints) by ``max_new_tokens`` tokens, greedily
    (``temperature=0``) or by plain temperature sampling, with ``edl.generate`` (KV cache,
    one compiled decode loop)."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": None}
    out = generate(
        model, jnp.asarray([prompt_ids], jnp.int32), max_new_tokens=max_new_tokens,
        key=jax.random.key(0) if key is None else key, **(sampling if temperature > 0 else {}),
    )  # fmt: skip
    return [int(t) for t in out.sequences[0]]


def run_generate(
    path: Path, prompt: str, *, max_new_tokens: int, temperature: float, seed: int
) -> None:
    """Print ``prompt`` continued by the model at ``path`` (a run directory, a checkpoint or
    a saved model)."""
    model = edl.from_pretrained(resolve_model(path))
    tokenizer = ByteTokenizer()
    ids = sample(model, tokenizer.encode(prompt), max_new_tokens, key=jax.random.key(seed),
                 temperature=temperature)  # fmt: skip
    print(tokenizer.decode(ids))
