"""What a checkpoint's files alone do not say: which linear layers carry LoRA adapters or are
quantized, with the static settings (rank, scaling, format, ...) needed to rebuild them.

``save_state`` stores :func:`layer_structure` in ``state.json`` (``"layers"``);
:func:`rebuild` applies it to a freshly built base model, so a checkpoint of a LoRA-wrapped or
quantized model loads without the code that built it (``edl.io.export.load_model``)::

    "layers": {
      "model.layers.self_attn.q_proj": {
        "lora": {"rank": 8, "scaling": 2.0, "dropout": 0.0, "dtype": "float32"},
        "quantized": {"format": "nf4", "block_size": 64, "scale_dtype": "float32",
                      "dtype": "float32"}
      }, ...
    }
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from edl.nn.layers import Linear
from edl.nn.lora import LoraLinear
from edl.nn.quantized import QuantizedLinear
from edl.ops.quant import QUANT_FORMATS
from edl.quantize import is_linear
from edl.tree import find, tree_apply

__all__ = ["layer_structure", "rebuild"]


def _quantized(layer: QuantizedLinear) -> dict[str, Any]:
    return {
        "format": layer.format,
        "block_size": int(layer.block_size),
        "scale_dtype": jnp.dtype(layer.scales.dtype).name,
        "dtype": layer.dtype,
    }


def layer_structure(model: PyTree) -> dict[str, dict[str, Any]]:
    """``edl path -> {"lora": {...}, "quantized": {...}}`` for every LoRA-wrapped or
    quantized linear layer of ``model`` (``{}`` for a plain model); JSON-serialisable."""
    out: dict[str, dict[str, Any]] = {}
    for path, layer in find(model, is_linear).items():
        entry: dict[str, Any] = {}
        base = layer
        if isinstance(layer, LoraLinear):
            entry["lora"] = {
                "rank": int(layer.rank),
                "scaling": float(layer.scaling),
                "dropout": float(layer.dropout),
                "dtype": jnp.dtype(layer.lora_A.weight.dtype).name,
            }
            base = layer.base_layer
        if isinstance(base, QuantizedLinear):
            entry["quantized"] = _quantized(base)
        if entry:
            out[path] = entry
    return out


def _rebuild_layer(spec: Mapping[str, Any], key: PRNGKeyArray, where: str):
    def apply(layer: Any) -> Any:
        if not isinstance(layer, Linear):
            raise ValueError(f"{where}: expected a plain Linear to rebuild, got {type(layer)}")
        if "quantized" in spec:
            q = spec["quantized"]
            # A format this process has not registered: say which layer records it.
            QUANT_FORMATS.lookup(q["format"], f"{where}: quantized.format")
            weight = layer.weight.astype(jnp.dtype(q["dtype"]))
            layer = QuantizedLinear.from_linear(
                eqx.tree_at(lambda m: m.weight, layer, weight),
                format=q["format"],
                block_size=q["block_size"],
                scale_dtype=q["scale_dtype"],
            )
        if "lora" in spec:
            lo = spec["lora"]
            layer = LoraLinear.init(
                layer,
                rank=lo["rank"],
                scaling=lo["scaling"],
                dropout=lo["dropout"],
                dtype=lo["dtype"],
                key=key,
            )
        return layer

    return apply


def rebuild(
    model: PyTree, structure: Mapping[str, Mapping[str, Any]], *, where: str = "rebuild"
) -> PyTree:
    """``model`` (a plain one, e.g. ``eqx.filter_eval_shape`` of ``init``) with the layers of
    ``structure`` (:func:`layer_structure`'s record) quantized and wrapped in LoRA adapters
    as recorded; the arrays are placeholders to load into. Errors name ``where``."""
    if not structure:
        return model
    linear = find(model, is_linear)
    unknown = sorted(set(structure) - set(linear))
    if unknown:
        raise ValueError(
            f"{where}: the recorded layers {unknown} are no linear layers of the "
            f"model (it has {sorted(linear)[:4]} ...)"
        )
    keys = jax.random.split(jax.random.key(0), len(structure))
    specs = zip(structure.items(), keys, strict=True)
    fns = {p: _rebuild_layer(s, k, f"{where}: {p}") for (p, s), k in specs}
    return tree_apply(fns, model, is_leaf=is_linear)
