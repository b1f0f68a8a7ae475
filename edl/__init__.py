"""edl: a functional, pure-pytree core for LLM research on JAX, Equinox and Optax.

Models are Equinox pytrees; ``split``/``merge`` separate the trainable arrays from the rest;
training state is a frozen pytree updated by pure functions; traversals are free functions
over ``"layers.3.self_attn.q_proj.weight"``-style key paths (``edl.tree``).
"""

from edl import lora, module, quantize, state, tree
from edl.io.hf import from_pretrained, from_state_dict, push_to_hub, save_pretrained, to_torch
from edl.module import (
    Trainable,
    abstract,
    count_params,
    merge,
    nbytes,
    split,
    summary,
    to_bfloat16,
    to_dtype,
    to_float,
    to_half,
    trainable_mask,
)
from edl.state import TrainState, apply_gradients, init_tx, value_and_grad
from edl.state import create as create_state
from edl.tree import flatten, load_into, named_map, unflatten, validate

__version__ = "0.1.0"

__all__ = [
    "TrainState",
    "Trainable",
    "__version__",
    "abstract",
    "apply_gradients",
    "count_params",
    "create_state",
    "flatten",
    "from_pretrained",
    "from_state_dict",
    "init_tx",
    "load_into",
    "lora",
    "merge",
    "module",
    "named_map",
    "nbytes",
    "push_to_hub",
    "quantize",
    "save_pretrained",
    "split",
    "state",
    "summary",
    "to_bfloat16",
    "to_dtype",
    "to_float",
    "to_half",
    "to_torch",
    "trainable_mask",
    "tree",
    "unflatten",
    "validate",
    "value_and_grad",
]
