"""Activation functions by their Hugging Face ``hidden_act`` names."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["ACTIVATIONS", "activation"]

# HF ``hidden_act`` names -> functions with the same numerics as transformers' ACT2FN.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    # CLIP's sigmoid approximation of GELU.
    "quick_gelu": lambda x: x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x),
}


def activation(name: str) -> Callable[[Array], Array]:
    """The activation for a HF ``hidden_act`` name; unknown names raise ``ValueError``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; edl supports {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
