"""Rotary position embeddings (RoPE) with HF's scaling types, each an entry of ``ROPE_TYPES``.

Tables are computed from the positions in the forward pass (never stored in a model), in
float32 as transformers does, and applied in HF's "rotate half" layout. A scaling type is a
``RopeType``: how it reads its HF keys, its inverse frequencies (which may depend on the
sequence length: ``dynamic``, ``longrope``), the attention factor that multiplies the cos / sin
tables (``yarn``, ``longrope``) and the keys it writes back. Registered: ``default``,
``linear``, ``dynamic`` (NTK-aware), ``llama3``, ``yarn`` and ``longrope`` (Phi-3's "su").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from edl._registry import Registry

__all__ = ["ROPE_TYPES", "RopeConfig", "RopeType", "apply_rope", "inv_frequencies", "rope_tables"]

SeqLen = int | Int[Array, ""] | None


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE settings; ``from_hf`` reads them from a HF ``config.json`` dict.

    Attributes:
        dim: number of rotated features per head (``head_dim * partial_rotary_factor``).
        theta: the base wavelength (``rope_theta``).
        rope_type: a ``ROPE_TYPES`` name.
        factor: the context extension (``linear``, ``dynamic``, ``llama3``, ``yarn``,
            ``longrope``; for the last two HF's ``max_position_embeddings /
            original_max_position_embeddings`` when ``config.json`` names none).
        original_max_position_embeddings: the pretraining context (``llama3``, ``yarn``,
            ``longrope``); for ``dynamic`` the length past which the base grows (HF's
            ``max_position_embeddings``).
        low_freq_factor, high_freq_factor: ``llama3``'s wavelength band.
        attention_factor: the cos / sin multiplier of ``yarn`` / ``longrope`` (``None``: the
            type's formula, see ``attention_scaling``).
        beta_fast, beta_slow, mscale, mscale_all_dim, truncate: ``yarn``'s ramp bounds (in
            rotations), its attention-factor terms and whether the ramp bounds are rounded.
        short_factor, long_factor: ``longrope``'s per-frequency divisors (``dim // 2`` each),
            long ones once a sequence exceeds ``original_max_position_embeddings``.
    """

    dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # lists from JSON: hashable tuples
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dim must be a positive even number, got {self.dim}")
        for name in ("theta", "factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RoPE {name} must be positive, got {getattr(self, name)}")
        entry = ROPE_TYPES.get(self.rope_type)
        if entry is None:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; edl implements {', '.join(ROPE_TYPES)}"
            )
        if entry.needs_original and self.original_max_position_embeddings is None:
            raise ValueError(f"rope type {self.rope_type!r} needs original_max_position_embeddings")
        entry.check(self)

    @property
    def attention_scaling(self) -> float:
        """The factor HF multiplies the cos / sin tables by (1 but for ``yarn`` /
        ``longrope``): attention logits grow by its square."""
        return ROPE_TYPES[self.rope_type].attention_scaling(self)

    @property
    def uses_length(self) -> bool:
        """Whether the frequencies depend on the sequence length (``dynamic``, ``longrope``)."""
        return ROPE_TYPES[self.rope_type].uses_length

    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any], head_dim: int, *, default_theta: float = 10000.0
    ) -> RopeConfig:
        """Read ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters``
        (transformers 5) from a HF config dict; ``default_theta`` is the family's when the
        dict names none. Unknown rope types and malformed values raise ``ValueError``."""
        merged = {
            **dict(config.get("rope_scaling") or {}),
            **dict(config.get("rope_parameters") or {}),
        }
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
        entry = ROPE_TYPES.get(rope_type) if isinstance(rope_type, str) else None
        if entry is None:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; edl implements {', '.join(ROPE_TYPES)}"
            )
        return cls(
            dim=int(head_dim * partial),
            theta=float(theta),
            rope_type=rope_type,
            **entry.read(merged, config),
        )

    def hf_parameters(self) -> dict[str, Any]:
        """HF's ``rope_parameters`` for this config, but ``partial_rotary_factor`` (which
        needs the head size: the model config writes it)."""
        return {
            "rope_type": self.rope_type,
            "rope_theta": self.theta,
            **ROPE_TYPES[self.rope_type].write(self),
        }


_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class RopeType:
    """One RoPE scaling type, an entry of ``ROPE_TYPES``.

    Attributes:
        name: HF's ``rope_type``.
        inv_freq: ``(config, seq_len) -> (dim // 2,)`` float32 inverse frequencies;
            ``seq_len`` (max position + 1, may be traced) is ``None`` unless ``uses_length``.
        read: ``(rope parameters, whole config.json dict) -> RopeConfig`` fields besides
            ``dim``, ``theta`` and ``rope_type`` (the parameters merge ``rope_scaling`` and
            ``rope_parameters``; numbers already checked).
        write: ``config -> `` the type's own ``rope_parameters`` keys.
        attention_scaling: ``config -> `` the cos / sin multiplier.
        check: raises ``ValueError`` for settings the type cannot run.
        needs_original: ``original_max_position_embeddings`` is required.
        uses_length: the frequencies depend on the sequence length.
    """

    name: str
    inv_freq: Callable[[RopeConfig, SeqLen], Float[Array, " half"]]
    read: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] = lambda p, c: {}
    write: Callable[[RopeConfig], dict[str, Any]] = lambda c: {}
    attention_scaling: Callable[[RopeConfig], float] = lambda c: 1.0
    check: Callable[[RopeConfig], None] = lambda c: None
    needs_original: bool = False
    uses_length: bool = False


def _base_exponents(dim: int) -> Float[Array, " half"]:
    return jnp.arange(0, dim, 2, dtype=jnp.float32) / dim


def _base_inv_freq(dim: int, theta: float | Float[Array, ""]) -> Float[Array, " half"]:
    return 1.0 / (theta ** _base_exponents(dim))


def _original_or_max(params: Mapping[str, Any], config: Mapping[str, Any]) -> int | None:
    """HF's rule: the pretraining context, else ``max_position_embeddings``."""
    original = params.get("original_max_position_embeddings")
    return config.get("max_position_embeddings") if original is None else original


# -- default, linear, dynamic, llama3 ------------------------------------------------------


def _read_factor(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    return {"factor": float(params.get("factor", 1.0))}


def _linear(c: RopeConfig, seq_len: SeqLen) -> Float[Array, " half"]:
    return _base_inv_freq(c.dim, c.theta) / c.factor


def _read_dynamic(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 grows the base past max_position_embeddings whatever the parameters say.
    original = config.get("max_position_embeddings", params.get("original_max_position_embeddings"))
    return {**_read_factor(params, config), "original_max_position_embeddings": original}


def _dynamic(c: RopeConfig, seq_len: SeqLen) -> Float[Array, " half"]:
    """NTK-aware: past the original context the base grows with the length."""
    if seq_len is None:
        return _base_inv_freq(c.dim, c.theta)
    original = c.original_max_position_embeddings
    length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), float(original))
    base = c.theta * ((c.factor * length / original) - (c.factor - 1)) ** (c.dim / (c.dim - 2))
    return _base_inv_freq(c.dim, base)


def _read_llama3(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_read_factor(params, config),
        "original_max_position_embeddings": _original_or_max(params, config),
        "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
    }


def _write_llama3(c: RopeConfig) -> dict[str, Any]:
    return {
        "factor": c.factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
        "low_freq_factor": c.low_freq_factor,
        "high_freq_factor": c.high_freq_factor,
    }


def _llama3(c: RopeConfig, seq_len: SeqLen) -> Float[Array, " half"]:
    """Llama 3.1: keep high frequencies, divide low ones by factor, interpolate between."""
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


# -- yarn ----------------------------------------------------------------------------------


def _read_extension(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``factor`` and the original context of ``yarn`` / ``longrope``: without a factor, HF
    takes the ratio of the two contexts."""
    original = _original_or_max(params, config)
    factor = params.get("factor")
    if factor is None and original:
        factor = config.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    return {
        "factor": float(1.0 if factor is None else factor),
        "original_max_position_embeddings": original,
        "attention_factor": None if attention is None else float(attention),
    }


def _read_yarn(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"config.json: RoPE truncate must be true or false, got {truncate!r}")
    optional = {k: params.get(k) for k in ("mscale", "mscale_all_dim")}
    return {
        **_read_extension(params, config),
        # HF: ``beta_fast or 32``, so 0 / None mean the default.
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        **{k: None if v is None else float(v) for k, v in optional.items()},
        "truncate": truncate,
    }


def _write_yarn(c: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "factor": c.factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
        "beta_fast": c.beta_fast,
        "beta_slow": c.beta_slow,
        "truncate": c.truncate,
    }
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(c, name) is not None:
            out[name] = getattr(c, name)
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaling(c: RopeConfig) -> float:
    """YaRN's attention factor: ``0.1 ln(factor) + 1``, or DeepSeek's ratio of two such
    terms when both ``mscale`` and ``mscale_all_dim`` are set (non-zero)."""
    if c.attention_factor is not None:
        return c.attention_factor
    if c.mscale and c.mscale_all_dim:
        return _yarn_mscale(c.factor, c.mscale) / _yarn_mscale(c.factor, c.mscale_all_dim)
    return _yarn_mscale(c.factor)


def _yarn_ramp_bounds(c: RopeConfig) -> tuple[float | int, float | int]:
    """The frequency indices where the ramp from extrapolation to interpolation starts and
    ends: where a frequency turns ``beta_fast`` / ``beta_slow`` times over the original
    context."""

    def index(rotations: float) -> float:
        turns = c.original_max_position_embeddings / (rotations * 2 * math.pi)
        return c.dim * math.log(turns) / (2 * math.log(c.theta))

    low, high = index(c.beta_fast), index(c.beta_slow)
    if c.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, c.dim - 1)
    return low, high + 0.001 if low == high else high  # HF's guard against 0 / 0


def _yarn(c: RopeConfig, seq_len: SeqLen) -> Float[Array, " half"]:
    """YaRN: high frequencies kept (extrapolated), low ones divided by ``factor``
    (interpolated), a linear ramp over the frequency index in between."""
    pos_freqs = c.theta ** _base_exponents(c.dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (c.factor * pos_freqs)
    low, high = _yarn_ramp_bounds(c)
    ramp = jnp.clip((jnp.arange(c.dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolated * (1 - keep) + extrapolated * keep


# -- longrope ------------------------------------------------------------------------------


def _read_longrope(params: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    out = _read_extension(params, config)
    for name in ("short_factor", "long_factor"):
        value = params.get(name)
        if not isinstance(value, list | tuple) or not all(_is_number(x) for x in value):
            raise ValueError(f"config.json: RoPE {name} must be a list of numbers, got {value!r}")
        out[name] = tuple(float(x) for x in value)
    return out


def _write_longrope(c: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "factor": c.factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
        "short_factor": list(c.short_factor),
        "long_factor": list(c.long_factor),
    }
    if c.attention_factor is not None:
        out["attention_factor"] = c.attention_factor
    return out


def _check_longrope(c: RopeConfig) -> None:
    for name in ("short_factor", "long_factor"):
        value = getattr(c, name)
        if value is None or len(value) != c.dim // 2:
            got = None if value is None else f"{len(value)} entries"
            raise ValueError(f"longrope {name} needs dim // 2 = {c.dim // 2} entries, got {got}")


def _longrope_scaling(c: RopeConfig) -> float:
    if c.attention_factor is not None:
        return c.attention_factor
    if c.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(c.factor) / math.log(c.original_max_position_embeddings))


def _longrope(c: RopeConfig, seq_len: SeqLen) -> Float[Array, " half"]:
    """LongRoPE: each frequency divided by its short factor, or by its long one once the
    sequence (max position + 1) exceeds the original context, for every position at once."""
    powers = c.theta ** _base_exponents(c.dim)
    short = 1.0 / (jnp.asarray(c.short_factor, jnp.float32) * powers)
    if seq_len is None:
        return short
    long = 1.0 / (jnp.asarray(c.long_factor, jnp.float32) * powers)
    return jnp.where(seq_len > c.original_max_position_embeddings, long, short)


ROPE_TYPES: Registry[RopeType] = Registry(
    "rope type",
    [
        RopeType("default", lambda c, s: _base_inv_freq(c.dim, c.theta)),
        RopeType("linear", _linear, _read_factor, lambda c: {"factor": c.factor}),
        RopeType(
            "dynamic",
            _dynamic,
            _read_dynamic,
            lambda c: {"factor": c.factor},
            needs_original=True,
            uses_length=True,
        ),
        RopeType("llama3", _llama3, _read_llama3, _write_llama3, needs_original=True),
        RopeType("yarn", _yarn, _read_yarn, _write_yarn, _yarn_scaling, needs_original=True),
        RopeType(
            "longrope",
            _longrope,
            _read_longrope,
            _write_longrope,
            _longrope_scaling,
            _check_longrope,
            needs_original=True,
            uses_length=True,
        ),
    ],
)


def inv_frequencies(config: RopeConfig, seq_len: SeqLen = None) -> Float[Array, " half"]:
    """Inverse frequencies ``(dim // 2,)`` in float32 of ``config``'s rope type.

    ``seq_len`` (max position + 1, may be traced) only matters for the types whose
    frequencies depend on it (``dynamic``, ``longrope``)."""
    return ROPE_TYPES[config.rope_type].inv_freq(config, seq_len)


def rope_tables(
    positions: Int[Array, "batch seq"],
    config: RopeConfig,
    valid: Bool[Array, "batch seq"] | Int[Array, "batch seq"] | None = None,
    *,
    per_row: bool = False,
    min_length: Int[Array, " batch"] | None = None,
) -> tuple[Float[Array, "batch seq dim"], Float[Array, "batch seq dim"]]:
    """``(cos, sin)`` tables for integer ``positions``, float32, in HF's layout (each
    frequency repeated over both halves), times the type's attention scaling.

    The length the ``dynamic`` / ``longrope`` frequencies depend on is the largest position
    + 1, over the ``valid`` (non-zero) slots only when given: a cached call's padding slots
    (a prompt bucket's width) do not count, as in transformers' ``generate``. That length
    is the whole batch's (transformers' batched rule) unless ``per_row``: then each row's
    own, so that a row's tables do not depend on the rows batched with it (the serving
    engine's independent requests). ``min_length``: each row's length is at least this (a
    chunk of a sequence that is longer as a whole: the serving engine's chunked prefill,
    whose early chunks must read the factors of the whole sequence's length)."""
    if not config.uses_length:
        inv_freq = inv_frequencies(config, None)[None, None, :]
    else:
        live = positions if valid is None else jnp.where(valid.astype(jnp.bool_), positions, 0)
        if min_length is not None:  # a length of n reads as a position of n - 1
            live = jnp.maximum(live, (min_length - 1)[:, None])
        if per_row:
            lengths = jnp.max(live, axis=1) + 1
            inv_freq = jax.vmap(lambda n: inv_frequencies(config, n))(lengths)[:, None, :]
        else:
            inv_freq = inv_frequencies(config, jnp.max(live) + 1)[None, None, :]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scale = config.attention_scaling
    if scale != 1.0:  # yarn / longrope: HF scales the tables, so q.k grows by scale ** 2
        cos, sin = cos * scale, sin * scale
    return cos, sin


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
