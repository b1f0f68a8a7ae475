"""Gated DeltaNet, Qwen3-Next's linear attention (transformers' ``Qwen3NextGatedDeltaNet``,
HF layout).

``in_proj_qkvz`` gives, per key head, its query, key, and the values and output gates ``z``
of the value heads it serves; ``in_proj_ba`` the write strengths ``b`` and decay inputs ``a``
of those value heads. q, k and v pass through a causal depthwise convolution
(``conv1d``, kernel ``linear_conv_kernel_dim``, no bias) and SiLU; q and k are
L2-normalised; ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated
delta rule (``edl.ops.delta_rule``) mixes the sequence; each value head's output is
RMS-normalised and gated by ``silu(z)`` (``GatedRMSNorm``) and projected by ``out_proj``.

With a cache the layer carries, per row, the convolution's last ``kernel - 1`` inputs and
the delta rule's ``(heads, dk, dv)`` state (``decode``): new tokens continue both, and
padded new tokens (right padding) leave both as they were.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from edl.nn.layers import Linear
from edl.ops.delta_rule import gated_delta_rule, gated_delta_step

__all__ = ["CausalConv1d", "GatedDeltaNet", "GatedRMSNorm", "l2_normalize"]

Hidden = Float[Array, "batch seq dim"]
Segments = Int[Array, "batch seq"]
ConvState = Float[Array, "batch kernel_minus_1 channels"]
DeltaState = Float[Array, "batch heads dk dv"]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (flash-linear-attention's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + jnp.asarray(eps, x.dtype))


class GatedRMSNorm(eqx.Module):
    """``weight * rms_norm(x) * silu(gate)`` (transformers' ``Qwen3NextRMSNormGated``): the
    norm in float32, cast back before the scale, the gate in float32."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True, default=1e-6)

    def __call__(self, x: Float[Array, "*b dim"], gate: Float[Array, "*b dim"]) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + jnp.float32(self.eps))).astype(dtype)
        y = self.weight.astype(dtype).reshape((1,) * (x.ndim - 1) + (-1,)) * normed
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


class CausalConv1d(eqx.Module):
    """Depthwise causal convolution, torch's ``Conv1d(groups=channels)`` weight
    ``(channels, 1, kernel)``, no bias, then SiLU."""

    weight: Float[Array, "channels 1 kernel"]

    def __call__(
        self,
        x: Float[Array, "batch seq channels"],
        state: ConvState,
        segments: Segments | None = None,
    ) -> Float[Array, "batch seq channels"]:
        """``x`` after ``state`` (the ``kernel - 1`` inputs before it; zeros at a start).
        ``segments``: packed sequences' ids; a token reads no input of another segment
        (the state counts as the first token's)."""
        kernel = self.weight.shape[-1]
        xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
        w = self.weight[:, 0, :].astype(x.dtype)  # (channels, kernel)
        seq = x.shape[1]
        taps = [xp[:, j : j + seq] * w[None, None, :, j] for j in range(kernel)]
        if segments is not None:
            before = jnp.repeat(segments[:, :1], kernel - 1, axis=1)
            ids = jnp.concatenate([before, segments], axis=1)
            zero = jnp.zeros((), x.dtype)
            same = lambda j: (ids[:, j : j + seq] == segments)[..., None]
            taps = [jnp.where(same(j), t, zero) for j, t in enumerate(taps)]
        return jax.nn.silu(sum(taps))


class GatedDeltaNet(eqx.Module):
    """Qwen3-Next's linear-attention token mixer (see the module docstring)."""

    in_proj_qkvz: Linear
    in_proj_ba: Linear
    conv1d: CausalConv1d
    dt_bias: Float[Array, " v_heads"]
    A_log: Float[Array, " v_heads"]  # HF's name
    norm: GatedRMSNorm
    out_proj: Linear
    num_k_heads: int = eqx.field(static=True)
    num_v_heads: int = eqx.field(static=True)
    head_k_dim: int = eqx.field(static=True)
    head_v_dim: int = eqx.field(static=True)

    @classmethod
    def init(
        cls,
        dim: int,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        std: float = 0.02,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ) -> GatedDeltaNet:
        """HF's initialisation: normal projections, ``dt_bias`` ones, ``A`` uniform in
        ``[0.01, 16)`` (``A_log`` its log), the gated norm's scale ones."""
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"GatedDeltaNet: linear_num_value_heads {num_v_heads} must be a multiple of "
                f"linear_num_key_heads {num_k_heads}"
            )
        kq, kb, kc, ka, ko = jax.random.split(key, 5)
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * key_dim + value_dim
        lin = {"std": std, "dtype": dtype}
        bound = 1.0 / conv_kernel**0.5  # torch's Conv1d default (fan_in = kernel)
        conv = jax.random.uniform(kc, (conv_dim, 1, conv_kernel), dtype, -bound, bound)
        a = jax.random.uniform(ka, (num_v_heads,), dtype, 0.01, 16.0)
        return cls(
            Linear.init(dim, 2 * key_dim + 2 * value_dim, key=kq, **lin),
            Linear.init(dim, 2 * num_v_heads, key=kb, **lin),
            CausalConv1d(conv),
            jnp.ones((num_v_heads,), dtype),
            jnp.log(a),
            GatedRMSNorm(jnp.ones((head_v_dim,), dtype), eps=eps),
            Linear.init(value_dim, dim, key=ko, **lin),
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
        )

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def conv_kernel(self) -> int:
        return self.conv1d.weight.shape[-1]

    def init_state(self, batch: int, dtype: DTypeLike) -> tuple[ConvState, DeltaState]:
        """Zero conv and delta states for ``batch`` rows (the delta state in float32 at
        least, as the delta rule computes)."""
        wide = jnp.promote_types(dtype, jnp.float32)
        dims = (batch, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        conv = jnp.zeros((batch, self.conv_kernel - 1, self.conv_channels), dtype)
        return conv, jnp.zeros(dims, wide)

    def __call__(
        self,
        x: Hidden,
        mask: Float[Array, "batch seq"] | None = None,
        *,
        impl: str = "auto",
        segments: Segments | None = None,
    ) -> Hidden:
        """The layer on whole sequences (zero states); ``mask`` zeroes padding's inputs
        (transformers' ``apply_mask_to_padding_states``). ``segments``: packed sequences'
        ids ``(batch, seq)``; each segment runs from zero conv and delta states, as alone."""
        conv, state = self.init_state(x.shape[0], x.dtype)
        return self.decode(x, conv, state, mask, impl=impl, segments=segments)[0]

    def decode(
        self,
        x: Hidden,
        conv_state: ConvState,
        delta_state: DeltaState,
        mask: Float[Array, "batch seq"] | None = None,
        *,
        impl: str = "auto",
        segments: Segments | None = None,
    ) -> tuple[Hidden, ConvState, DeltaState]:
        """New tokens after the given states: the output and the states after each row's
        last valid token (``mask``: 1 for valid new tokens, right-padded; ``None``: all).
        ``segments`` (``__call__``): packed sequences' ids, both states restart at each."""
        b, s, _ = x.shape
        if mask is not None:
            x = x * mask[..., None].astype(x.dtype)
        q, k, v, z, beta_in, a = self._project(x)
        mixed = jnp.concatenate([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], -1)
        new_conv = _next_conv_state(conv_state, mixed, mask)
        mixed = self.conv1d(mixed, conv_state, segments)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = jnp.split(mixed, [key_dim, 2 * key_dim], axis=-1)
        r = self.num_v_heads // self.num_k_heads
        heads = lambda t, d: jnp.repeat(t.reshape(b, s, -1, d), r, axis=2)
        q = l2_normalize(heads(q, self.head_k_dim).astype(jnp.float32))
        k = l2_normalize(heads(k, self.head_k_dim).astype(jnp.float32))
        v = v.reshape(b, s, self.num_v_heads, self.head_v_dim)
        beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
        per_head = lambda w: w.astype(jnp.float32).reshape(1, 1, -1)
        g = -jnp.exp(per_head(self.A_log)) * jax.nn.softplus(
            a.astype(jnp.float32) + per_head(self.dt_bias)
        )
        if mask is not None:  # padding neither decays nor writes the state
            valid = mask.astype(jnp.float32)[..., None]
            g, beta = g * valid, beta * valid
        if s == 1:
            out, delta_state = gated_delta_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], delta_state
            )
            out = out[:, None].astype(v.dtype)
        else:
            resets = None
            if segments is not None:  # a token whose segment differs from its left one
                starts = segments[:, 1:] != segments[:, :-1]
                resets = jnp.pad(starts, [(0, 0), (1, 0)])
            out, delta_state = gated_delta_rule(
                q, k, v, g, beta, delta_state, impl=impl, resets=resets
            )
        out = self.norm(out.astype(x.dtype), z).reshape(b, s, -1)
        return self.out_proj(out), new_conv, delta_state.astype(delta_state.dtype)

    def _project(self, x: Hidden):
        """q, k ``(b, s, k_heads, dk)``, v, z ``(b, s, v_heads, dv)``, b, a
        ``(b, s, v_heads)``: transformers' ``fix_query_key_value_ordering``."""
        bsz, s, _ = x.shape
        nk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // nk
        qkvz = self.in_proj_qkvz(x).reshape(bsz, s, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(bsz, s, nk, 2 * r)
        beta_in, a = jnp.split(ba, 2, axis=-1)
        per_head = lambda t: t.reshape(bsz, s, self.num_v_heads, -1)
        flat = lambda t: t.reshape(bsz, s, self.num_v_heads)
        return q, k, per_head(v), per_head(z), flat(beta_in), flat(a)


def _next_conv_state(
    state: ConvState, x: Float[Array, "batch seq channels"], mask: jax.Array | None
) -> ConvState:
    """The ``kernel - 1`` inputs before each row's next token: the last ones of
    ``state ++ x[:valid]``."""
    width = state.shape[1]
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    if mask is None:
        return xp[:, xp.shape[1] - width :].astype(state.dtype)
    valid = jnp.sum(mask.astype(jnp.int32), axis=1)  # right-padded new tokens
    idx = valid[:, None] + jnp.arange(width, dtype=jnp.int32)[None]  # (b, width)
    return jnp.take_along_axis(xp, idx[..., None], axis=1).astype(state.dtype)
