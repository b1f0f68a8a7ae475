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
    """``down_proj(act(gate_proj(x)) * up_proj(x))``; with ``act="silu"`` this is SwiGLU.

    With ``fused`` (Phi-3) one ``gate_up_proj`` of ``2 * intermediate`` outputs, gate then
    up, replaces the two (``gate_proj`` / ``up_proj`` are ``None``)."""

    gate_proj: Linear | None
    up_proj: Linear | None
    down_proj: Linear
    act: str = eqx.field(static=True, default="silu")
    gate_up_proj: Linear | None = None

    @classmethod
    def init(
        cls,
        dim: int,
        intermediate: int,
        *,
        act: str = "silu",
        use_bias: bool = False,
        fused: bool = False,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GatedMLP:
        activation(act)  # fail at construction, not at the first call
        kg, ku, kd = jax.random.split(key, 3)
        kw = {"use_bias": use_bias, "std": std, "dtype": dtype}
        if fused:
            down = Linear.init(intermediate, dim, key=kd, **kw)
            gate_up = Linear.init(dim, 2 * intermediate, key=kg, **kw)
            return cls(None, None, down, act=act, gate_up_proj=gate_up)
        return cls(
            Linear.init(dim, intermediate, key=kg, **kw),
            Linear.init(dim, intermediate, key=ku, **kw),
            Linear.init(intermediate, dim, key=kd, **kw),
            act=act,
        )

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        if self.gate_up_proj is not None:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activation(self.act)(gate) * up)
