"""Gated MLP (SwiGLU and friends): ``down(act(gate(x)) * up(x))``, HF layout."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.nn.layers import Linear
from edl.ops.activations import activation

__all__ = [
    "GatedMLP",
]


class GatedMLP(eqx.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``; with ``act="silu"`` this is SwiGLU."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    act: str = eqx.field(static=True, default="silu")

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        *,
        act: str = "silu",
        use_bias: bool = False,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GatedMLP:
        activation(act)  # fail at construction, not at the first call
        kg, ku, kd = jax.random.split(key, 3)
        kw = {"use_bias": use_bias, "std": std, "dtype": dtype}
        return cls(
            Linear.init(dim, intermediate, key=kg, **kw),
            Linear.init(dim, intermediate, key=ku, **kw),
            Linear.init(intermediate, dim, key=kd, **kw),
            act=act,
        )

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activation(self.act)(gate) * up)
