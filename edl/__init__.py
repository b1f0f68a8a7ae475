"""edl: a functional, pure-pytree core for LLM research on JAX, Equinox and Optax.

Models are Equinox pytrees; ``split``/``merge`` separate the trainable arrays from the rest;
training state is a frozen pytree updated by pure functions; traversals are free functions
over ``"layers.3.self_attn.q_proj.weight"``-style key paths (``edl.tree``).

The names below load on first use, so ``import edl`` (and the ``edl`` command's ``--help``)
import no jax until one is needed.
"""

from edl._lazy import lazy_attributes

__version__ = "0.1.0"

_MODULES = {
    "edl.io.formats.hf": (
        "from_pretrained",
        "from_state_dict",
        "push_to_hub",
        "save_pretrained",
        "to_torch",
    ),
    "edl.compile_cache": ("enable_compile_cache",),
    "edl.module": ("abstract", "count_params", "merge", "nbytes", "split", "summary", "to_dtype"),
    "edl.state": ("TrainState", "apply_gradients", "value_and_grad"),
}
_EXPORTS = {
    **{name: f"edl.{name}" for name in ("lora", "module", "quantize", "state", "tree")},
    **{name: f"{module}:{name}" for module, names in _MODULES.items() for name in names},
    "create_state": "edl.state:create",
}

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = ["__version__", *sorted(_EXPORTS)]
