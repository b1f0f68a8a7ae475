"""Rotary position embeddings (RoPE) with HF's scaling types: default, linear, dynamic, llama3.

Tables are computed from the positions in the forward pass (never stored in a model), in
float32 as transformers does, and applied in HF's "rotate half" layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["RopeConfig", "apply_rope", "rope_tables"]

RopeType = Literal["default", "linear", "dynamic", "llama3"]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE settings; ``from_hf`` reads them from a HF ``config.json`` dict.

    Attributes:
        dim: number of rotated features per head (``head_dim * partial_rotary_factor``).
        theta: the base wavelength (``rope_theta``).
        rope_type: ``default``, ``linear`` (positions / factor), ``dynamic`` (NTK-aware base
            growing past ``original_max_position_embeddings``) or ``llama3`` (Llama 3.1
            wavelength-band smoothing).
    """

    dim: int
    theta: float = 10000.0
    rope_type: RopeType = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dim must be a positive even number, got {self.dim}")
        for name in ("theta", "factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RoPE {name} must be positive, got {getattr(self, name)}")
        if self.rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; edl implements default, linear, "
                "dynamic and llama3"
            )
        if (
            self.rope_type in ("dynamic", "llama3")
            and self.original_max_position_embeddings is None
        ):
            raise ValueError(f"rope type {self.rope_type!r} needs original_max_position_embeddings")

    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any], head_dim: int, *, default_theta: float = 10000.0
    ) -> RopeConfig:
        """Read ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters``
        (transformers 5) from a HF config dict; ``default_theta`` is the family's when the
        dict names none. Unknown rope types raise ``ValueError``."""
        params = dict(config.get("rope_parameters") or {})
        scaling = dict(config.get("rope_scaling") or {})
        merged = {**scaling, **params}
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        theta = merged.get("rope_theta", config.get("rope_theta", default_theta))
        partial = merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        numbers = {
            **{k: merged.get(k) for k in _NUMBERS},
            "rope_theta": theta,
            "partial_rotary_factor": partial,
        }
        for key, value in numbers.items():
            if value is not None and not _is_number(value):
                raise ValueError(f"config.json: RoPE {key} must be a number, got {value!r}")
        original = merged.get("original_max_position_embeddings")
        if original is not None and (not isinstance(original, int) or isinstance(original, bool)):
            raise ValueError(
                "config.json: RoPE original_max_position_embeddings must be an integer, "
                f"got {original!r}"
            )
        if not 0 < partial <= 1:
            raise ValueError(
                f"config.json: partial_rotary_factor must lie in (0, 1], got {partial!r}"
            )
        if rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(
                f"unsupported rope type {rope_type!r}; edl implements default, linear, "
                "dynamic and llama3"
            )
        if rope_type == "dynamic" and original is None:
            original = config.get("max_position_embeddings")
        return cls(
            dim=int(head_dim * partial),
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            original_max_position_embeddings=original,
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        )


_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor")


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _base_inv_freq(dim: int, theta: float | Float[Array, ""]) -> Float[Array, " half"]:
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return 1.0 / (theta**exponents)


def inv_frequencies(
    config: RopeConfig, seq_len: int | Int[Array, ""] | None = None
) -> Float[Array, " half"]:
    """Inverse frequencies ``(dim // 2,)`` in float32.

    ``seq_len`` (max position + 1, may be traced) only matters for ``dynamic``: past the
    original context the base grows as in HF's dynamic NTK scaling.
    """
    c = config
    if c.rope_type == "default":
        return _base_inv_freq(c.dim, c.theta)
    if c.rope_type == "linear":
        return _base_inv_freq(c.dim, c.theta) / c.factor
    if c.rope_type == "dynamic":
        if seq_len is None:
            return _base_inv_freq(c.dim, c.theta)
        original = c.original_max_position_embeddings
        length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), float(original))
        base = c.theta * ((c.factor * length / original) - (c.factor - 1)) ** (c.dim / (c.dim - 2))
        return _base_inv_freq(c.dim, base)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    inv_freq = _base_inv_freq(c.dim, c.theta)
    low_wavelen = c.original_max_position_embeddings / c.low_freq_factor
    high_wavelen = c.original_max_position_embeddings / c.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / c.factor, inv_freq)
    smooth = (c.original_max_position_embeddings / wavelen - c.low_freq_factor) / (
        c.high_freq_factor - c.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / c.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    positions: Int[Array, "batch seq"], config: RopeConfig
) -> tuple[Float[Array, "batch seq dim"], Float[Array, "batch seq dim"]]:
    """``(cos, sin)`` tables for integer ``positions``, float32, in HF's layout
    (each frequency repeated over both halves)."""
    seq_len = jnp.max(positions) + 1 if config.rope_type == "dynamic" else None
    inv_freq = inv_frequencies(config, seq_len)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"],
    cos: Float[Array, "batch seq dim"],
    sin: Float[Array, "batch seq dim"],
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate the first ``dim`` features of each head of ``x``; the rest pass through.

    Computed in float32 and cast back to ``x.dtype``.
    """
    dim = cos.shape[-1]
    if dim > x.shape[-1]:
        raise ValueError(f"rope dim {dim} exceeds head_dim {x.shape[-1]}")
    rot, rest = x[..., :dim].astype(jnp.float32), x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)
