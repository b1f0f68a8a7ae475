"""LoRA on MoE expert weights: PEFT's ``ParamWrapper`` (``LoraConfig(target_parameters=...)``)
as a pytree.

transformers 5 keeps an MoE layer's experts as 3-D parameters (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``), not ``nn.Linear`` layers, so PEFT adapts them per *parameter*:
for a parameter of ``E`` experts, ``in`` inputs and ``out`` outputs it keeps

    lora_A.weight  (r * E, in)     rows expert-major:  A[e * r + k, i]
    lora_B.weight  (out, r * E)    columns rank-major: B[o, k * E + e]

and adds ``delta[e] = scaling * B_e @ A_e`` (``(out, in)`` per expert, ``scaling = alpha / r``,
``alpha / sqrt(r)`` with rsLoRA) to the parameter, laid out as the parameter is: ``(E, out,
in)`` for Mixtral-style experts, ``(E, in, out)`` for GPT-OSS (transformers'
``is_transposed``). ``LoraExperts`` wraps an experts module with one ``LoraParam`` per adapted
HF parameter, in exactly those shapes, so PEFT's files load and save unchanged.

edl's Mixtral-style ``Experts`` keep gate and up apart; HF's ``gate_up_proj`` is their
concatenation along the output axis, so one adapter covers both (``EXPERT_PARAMS``).

The forward adds the delta to the expert weights (one merged copy of the adapted expert
weights per layer while it runs, as PEFT's own forward does with its ``baddbmm``): edl's
expert dispatch (blocked with a hand-written backward, capacity, ragged, dense, expert
parallel) takes weight arrays, and a factored ``x A^T B^T`` per routed row would need a second
grouped matmul in each of them. The cost: the adapted weights' size in transient memory
per layer, and in the backward pass the gradient of the merged weight (full expert size, as
full fine-tuning of those weights computes) before it is contracted to ``dA`` / ``dB``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.gpt_oss_moe import GptOssExperts
from edl.nn.moe import Experts

__all__ = [
    "EXPERT_PARAMS",
    "ExpertParam",
    "Factor",
    "LoraExperts",
    "LoraParam",
    "hf_param",
    "hf_shape",
    "wrap_experts",
]


@dataclasses.dataclass(frozen=True)
class ExpertParam:
    """One HF expert parameter as edl stores it: ``fields`` of the experts module,
    concatenated along the output axis, make it; ``transposed``: HF lays it out ``(experts,
    in, out)`` (GPT-OSS) rather than ``(experts, out, in)``."""

    fields: tuple[str, ...]
    transposed: bool = False

    @property
    def out_axis(self) -> int:
        return -1 if self.transposed else -2


# Per experts class, its HF parameters in transformers' registration order: PEFT nests one
# wrapper per adapted parameter in that order, which names the file's keys
# (``experts.base_layer.lora_A.weight`` is the first of two).
EXPERT_PARAMS: dict[type, dict[str, ExpertParam]] = {
    Experts: {
        "gate_up_proj": ExpertParam(("gate_proj", "up_proj")),
        "down_proj": ExpertParam(("down_proj",)),
    },
    GptOssExperts: {
        "gate_up_proj": ExpertParam(("gate_up_proj",), transposed=True),
        "down_proj": ExpertParam(("down_proj",), transposed=True),
    },
}


def expert_params(experts: Any) -> dict[str, ExpertParam]:
    """The adaptable HF parameters of an experts module; ``TypeError`` for another object."""
    spec = EXPERT_PARAMS.get(type(experts))
    if spec is None:
        raise TypeError(f"LoRA on expert weights: no parameters known for {type(experts).__name__}")
    return spec


def hf_shape(experts: Any, name: str) -> tuple[int, ...]:
    """The shape of HF parameter ``name`` of ``experts`` (nothing concatenated)."""
    spec = expert_params(experts)[name]
    shapes = [getattr(experts, f).shape for f in spec.fields]
    axis = len(shapes[0]) + spec.out_axis
    return (*shapes[0][:axis], sum(s[axis] for s in shapes), *shapes[0][axis + 1 :])


def hf_param(experts: Any, name: str) -> Float[Array, "*lead experts d1 d2"]:
    """The HF parameter ``name`` of ``experts`` (its edl fields concatenated)."""
    spec = expert_params(experts)[name]
    arrays = [getattr(experts, f) for f in spec.fields]
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=spec.out_axis)


class Factor(eqx.Module):
    """A LoRA factor's ``weight`` (not a ``Linear``: PEFT's ``lora_A`` / ``lora_B`` of an
    expert parameter are no layer of the model, and "all-linear" must not see them)."""

    weight: Array


class LoraParam(eqx.Module):
    """PEFT's adapter of one ``(experts, d1, d2)`` parameter (module docstring for shapes)."""

    lora_A: Factor
    lora_B: Factor
    scaling: float = eqx.field(static=True)
    transposed: bool = eqx.field(static=True, default=False)

    @classmethod
    def init(
        cls,
        shape: tuple[int, ...],
        *,
        rank: int,
        scaling: float,
        transposed: bool,
        dtype: DTypeLike,
        key: PRNGKeyArray,
    ) -> LoraParam:
        """Adapters of a parameter of ``shape`` ``(*lead, experts, d1, d2)``: ``lora_A ~
        U(-1/sqrt(in), 1/sqrt(in))`` (PEFT's draw), ``lora_B = 0``."""
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        *lead, experts, d1, d2 = shape
        fan_in, fan_out = (d1, d2) if transposed else (d2, d1)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(key, (*lead, rank * experts, fan_in), dtype, -bound, bound)
        b = jnp.zeros((*lead, fan_out, rank * experts), dtype)
        return cls(Factor(a), Factor(b), scaling=float(scaling), transposed=transposed)

    @property
    def rank_experts(self) -> int:
        return self.lora_A.weight.shape[-2]

    def delta(self, experts: int) -> Float[Array, "*lead experts d1 d2"]:
        """``scaling * B_e @ A_e`` per expert in float32, laid out as the parameter
        (PEFT's ``get_delta_weight``)."""
        a, b = self.lora_A.weight.astype(jnp.float32), self.lora_B.weight.astype(jnp.float32)
        *lead, re, fan_in = a.shape
        a = a.reshape(*lead, experts, re // experts, fan_in)  # [e, k, i] = A[e * r + k, i]
        b = b.reshape(*lead, b.shape[-2], re // experts, experts)  # [o, k, e] = B[o, k * E + e]
        out = "eio" if self.transposed else "eoi"
        return self.scaling * jnp.einsum(f"...oke,...eki->...{out}", b, a)


class LoraExperts(eqx.Module):
    """An experts module (``base_layer``, frozen) with PEFT adapters on some of its HF
    parameters (``adapters``: HF name -> ``LoraParam``). Reading an edl field of the base
    (``gate_proj``, ``gate_up_proj``, ``alpha``, ...) gives its adapted value, so the MoE
    layers run it as they run their own experts."""

    base_layer: Experts | GptOssExperts
    adapters: dict[str, LoraParam]  # key order: sorted (a jax dict), not transformers'

    @property
    def num_experts(self) -> int:
        field = next(iter(expert_params(self.base_layer).values())).fields[0]
        return getattr(self.base_layer, field).shape[-3]

    def merged_param(self, name: str) -> Float[Array, "*lead experts d1 d2"]:
        """HF parameter ``name`` plus its delta, in float32, returned in the base's dtype."""
        base = hf_param(self.base_layer, name)
        if name not in self.adapters:
            return base
        delta = self.adapters[name].delta(self.num_experts)
        return (base.astype(jnp.float32) + delta).astype(base.dtype)

    def _field(self, field: str) -> Array:
        for name, spec in expert_params(self.base_layer).items():
            if field in spec.fields and name in self.adapters:
                merged = self.merged_param(name)
                sizes = [getattr(self.base_layer, f).shape[spec.out_axis] for f in spec.fields]
                start = sum(sizes[: spec.fields.index(field)])
                size = sizes[spec.fields.index(field)]
                return jax.lax.slice_in_dim(merged, start, start + size, axis=spec.out_axis)
        return getattr(self.base_layer, field)

    def __getattr__(self, name: str) -> Any:
        # Only for names the wrapper lacks: the base's fields (adapted) and attributes.
        if name.startswith("_") or name in ("base_layer", "adapters"):
            raise AttributeError(name)
        base = self.base_layer
        if name in {f.name for f in dataclasses.fields(base)}:
            return self._field(name)
        return getattr(base, name)

    def merge(self) -> Experts | GptOssExperts:
        """The base with every adapter folded in (``W + scaling * B A`` in float32)."""
        base = self.base_layer
        fields = [f for n in self.adapters for f in expert_params(base)[n].fields]
        return eqx.tree_at(
            lambda m: [getattr(m, f) for f in fields], base, [self._field(f) for f in fields]
        )


def wrap_experts(
    experts: Experts | GptOssExperts,
    params: dict[str, tuple[int, float]],
    *,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
) -> LoraExperts:
    """``experts`` with adapters on the HF parameters ``params`` (name -> (rank, scaling)),
    kept in transformers' order; ``ValueError`` naming an unknown parameter."""
    spec = expert_params(experts)
    unknown = sorted(set(params) - set(spec))
    if unknown:
        raise ValueError(
            f"LoRA on expert weights: {type(experts).__name__} has no parameters {unknown}; "
            f"it has {list(spec)}"
        )
    names = [n for n in spec if n in params]
    keys = jax.random.split(key, len(names))
    adapters = {
        n: LoraParam.init(
            hf_shape(experts, n),
            rank=params[n][0],
            scaling=params[n][1],
            transposed=spec[n].transposed,
            dtype=getattr(experts, spec[n].fields[0]).dtype if dtype is None else dtype,
            key=k,
        )
        for n, k in zip(names, keys, strict=True)
    }
    return LoraExperts(experts, adapters)
