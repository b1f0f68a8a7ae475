"""Configs of the CLIP / SigLIP towers and of the dual-encoder models built from them.

A tower config (``CLIPTextConfig``, ``CLIPVisionConfig``, ``SiglipTextConfig``,
``SiglipVisionConfig``) is a frozen dataclass whose fields are the HF ``config.json`` keys edl
interprets, with transformers' defaults for that class; the other keys stay in ``hf_extra``
and are written back by ``to_hf``. ``run`` holds the run options (scan or unroll, remat,
attention implementation), as ``edl.models.config.RunOptions`` does for decoders. The
dual-encoder configs (``CLIPConfig``, ``SiglipConfig``) nest one text and one vision config
as HF does (``text_config`` / ``vision_config``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from edl.models.config import RUN_OPTIONS, RunOptions, _route_run_options
from edl.models.validation import check_fields, check_hf_values
from edl.ops.activations import activation

__all__ = [
    "CLIPConfig",
    "CLIPTextConfig",
    "CLIPVisionConfig",
    "SiglipConfig",
    "SiglipTextConfig",
    "SiglipVisionConfig",
    "TextTowerConfig",
    "TowerConfig",
    "VisionTowerConfig",
]

# Keys that describe the stored file rather than the model; save_pretrained rewrites them.
_REWRITTEN = frozenset({"architectures", "dtype", "torch_dtype", "transformers_version"})


_DUAL_KEYS = frozenset(
    {"model_type", "text_config", "vision_config", "text_config_dict", "vision_config_dict"}
)


def _extra(c: Mapping[str, Any], read: frozenset[str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, json.dumps(v)) for k, v in c.items() if k not in read | _REWRITTEN))


def _check_model_type(cls: type, c: Mapping[str, Any], default: str) -> dict[str, Any]:
    if not isinstance(c, Mapping):
        raise ValueError(f"{cls.__name__}: config must be a JSON object, got {c!r:.80}")
    c = {"model_type": default, **c}
    if c["model_type"] not in cls.MODEL_TYPES:
        raise ValueError(
            f"config.json: unsupported model_type {c['model_type']!r}; {cls.__name__} covers "
            f"{cls.MODEL_TYPES}"
        )
    return c


@dataclasses.dataclass(frozen=True)
class TowerConfig:
    """The fields every encoder tower has (HF names)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    # What a built tower may change besides its run options (``edl.models.heads.reconfigure``):
    # an init-only value and the HF keys edl does not interpret.
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"run", "initializer_range", "hf_extra"})

    model_type: str = ""
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    hf_extra: tuple[tuple[str, str], ...] = ()
    run: RunOptions = dataclasses.field(default_factory=RunOptions)

    def __post_init__(self) -> None:
        check_fields(self, vars(self))
        if self.model_type not in self.MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; {type(self).__name__} covers "
                f"{self.MODEL_TYPES}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if not isinstance(self.run, RunOptions):
            raise ValueError(f"run must be a RunOptions, got {self.run!r}")
        activation(self.hidden_act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **changes: Any) -> TowerConfig:
        """A copy with ``changes``: fields, or run options by name (``scan_layers=False``)."""
        return dataclasses.replace(self, **_route_run_options(self.run, changes))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> TowerConfig:
        """Read a HF ``config.json`` dict (or a dual encoder's ``text_config`` /
        ``vision_config``, whose ``model_type`` may be missing); ``overrides`` set fields or
        run options. Wrong types and values raise ``ValueError`` naming the key."""
        c = _check_model_type(cls, config, cls.MODEL_TYPES[0])
        check_hf_values(c)
        names = frozenset(f.name for f in dataclasses.fields(cls)) - {"hf_extra", "run"}
        fields = {k: c[k] for k in names if k in c}
        fields["hf_extra"] = _extra(c, names)
        try:
            return cls(**_route_run_options(RunOptions(), {**fields, **overrides}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json ({c['model_type']}): {e}") from e

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same tower."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        for f in dataclasses.fields(self):
            if f.name not in ("hf_extra", "run"):
                out[f.name] = getattr(self, f.name)
        if architectures is not None:
            out["architectures"] = list(architectures)
        return out


@dataclasses.dataclass(frozen=True)
class TextTowerConfig(TowerConfig):
    """A text tower: token and learned position embeddings (``max_position_embeddings``
    tokens at most). ``projection_dim``: CLIP's ``text_projection`` width;
    ``projection_size``: SigLIP's text ``head`` width (``None``: ``hidden_size``)."""

    vocab_size: int = 49408
    max_position_embeddings: int = 77
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407
    projection_dim: int | None = None
    projection_size: int | None = None


@dataclasses.dataclass(frozen=True)
class VisionTowerConfig(TowerConfig):
    """A vision tower over ``image_size`` square images of ``num_channels`` channels cut into
    ``patch_size`` patches. ``projection_dim``: CLIP's ``visual_projection`` width;
    ``vision_use_head``: SigLIP's attention-pooling head."""

    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    projection_dim: int | None = None
    vision_use_head: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(TextTowerConfig):
    """transformers' ``CLIPTextConfig`` defaults."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("clip_text_model",)

    model_type: str = "clip_text_model"
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    projection_dim: int | None = 512


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig(VisionTowerConfig):
    """transformers' ``CLIPVisionConfig`` defaults."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("clip_vision_model",)

    model_type: str = "clip_vision_model"
    projection_dim: int | None = 512


@dataclasses.dataclass(frozen=True)
class SiglipTextConfig(TextTowerConfig):
    """transformers' ``SiglipTextConfig`` defaults."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("siglip_text_model",)

    model_type: str = "siglip_text_model"
    vocab_size: int = 32000
    max_position_embeddings: int = 64
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def head_size(self) -> int:
        """The text ``head``'s output width."""
        return self.projection_size or self.hidden_size


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig(VisionTowerConfig):
    """transformers' ``SiglipVisionConfig`` defaults."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("siglip_vision_model",)

    model_type: str = "siglip_vision_model"
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    vision_use_head: bool | None = True


def replace_nested(config: Any, changes: Mapping[str, Any]) -> Any:
    """``config`` (holding a ``text_config`` and a ``vision_config``) with ``changes``: its
    own fields, and run options (``scan_layers=False``) applied to both nested configs."""
    options = {k: v for k, v in changes.items() if k in RUN_OPTIONS}
    fields = {k: v for k, v in changes.items() if k not in RUN_OPTIONS}
    if options:
        for name in ("text_config", "vision_config"):
            fields[name] = fields.get(name, getattr(config, name)).replace(**options)
    return dataclasses.replace(config, **fields)


@dataclasses.dataclass(frozen=True)
class DualEncoderConfig:
    """A text tower and a vision tower (HF ``text_config`` / ``vision_config``)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    # Besides run options (to both towers) and the towers' own ``SETTINGS``.
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"hf_extra"})
    TEXT: ClassVar[type[TextTowerConfig]] = TextTowerConfig
    VISION: ClassVar[type[VisionTowerConfig]] = VisionTowerConfig

    text_config: TextTowerConfig
    vision_config: VisionTowerConfig
    model_type: str = ""
    hf_extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in self.MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r} for {type(self).__name__}"
            )
        for name, cls in (("text_config", self.TEXT), ("vision_config", self.VISION)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"{type(self).__name__}.{name} must be a {cls.__name__}, got "
                    f"{type(getattr(self, name)).__name__}"
                )

    def replace(self, **changes: Any) -> DualEncoderConfig:
        """A copy with ``changes``; run options (``scan_layers=False``) go to both towers."""
        return replace_nested(self, changes)

    @classmethod
    def _towers_from_hf(cls, c: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
        unknown = sorted(set(overrides) - RUN_OPTIONS)
        if unknown:
            raise ValueError(
                f"{cls.__name__}.from_hf: unknown overrides {unknown} (run options "
                f"only: {sorted(RUN_OPTIONS)})"
            )
        towers = {}
        for name, tower in (("text_config", cls.TEXT), ("vision_config", cls.VISION)):
            sub, legacy = c.get(name) or {}, c.get(f"{name}_dict") or {}
            for key, value in ((name, sub), (f"{name}_dict", legacy)):
                if not isinstance(value, Mapping):
                    raise ValueError(f"config.json: {key} must be an object, got {value!r:.80}")
            # Early CLIP files kept the tower settings in ``*_config_dict``, which
            # transformers lets win over ``*_config``.
            towers[name] = tower.from_hf({**sub, **legacy}, **overrides)
        return towers

    def _to_hf(self, fields: dict[str, Any], architectures: list[str] | None) -> dict[str, Any]:
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        out.update(
            model_type=self.model_type,
            text_config=self.text_config.to_hf(),
            vision_config=self.vision_config.to_hf(),
            **fields,
        )
        if architectures is not None:
            out["architectures"] = list(architectures)
        return out


@dataclasses.dataclass(frozen=True)
class CLIPConfig(DualEncoderConfig):
    """transformers' ``CLIPConfig``: towers, ``projection_dim`` (the shared embedding width)
    and ``logit_scale_init_value`` (``logit_scale``'s initial value, log of 1 / 0.07)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("clip",)
    SETTINGS: ClassVar[frozenset[str]] = frozenset({"hf_extra", "logit_scale_init_value"})
    TEXT: ClassVar[type[TextTowerConfig]] = CLIPTextConfig
    VISION: ClassVar[type[VisionTowerConfig]] = CLIPVisionConfig

    text_config: CLIPTextConfig = CLIPTextConfig()
    vision_config: CLIPVisionConfig = CLIPVisionConfig()
    model_type: str = "clip"
    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, vars(self))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> CLIPConfig:
        """Read a HF ``config.json`` dict; ``overrides``: run options for both towers."""
        c = _check_model_type(cls, config, "clip")
        towers = cls._towers_from_hf(c, overrides)
        read = _DUAL_KEYS | {"projection_dim", "logit_scale_init_value"}
        kept = {k: c[k] for k in ("projection_dim", "logit_scale_init_value") if k in c}
        try:
            return cls(**towers, **kept, hf_extra=_extra(c, read))
        except ValueError as e:
            raise ValueError(f"config.json: {e}") from e

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        fields = {
            "projection_dim": self.projection_dim,
            "logit_scale_init_value": self.logit_scale_init_value,
        }
        return self._to_hf(fields, architectures)


@dataclasses.dataclass(frozen=True)
class SiglipConfig(DualEncoderConfig):
    """transformers' ``SiglipConfig``: a text and a vision tower."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("siglip",)
    TEXT: ClassVar[type[TextTowerConfig]] = SiglipTextConfig
    VISION: ClassVar[type[VisionTowerConfig]] = SiglipVisionConfig

    text_config: SiglipTextConfig = SiglipTextConfig()
    vision_config: SiglipVisionConfig = SiglipVisionConfig()
    model_type: str = "siglip"

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> SiglipConfig:
        """Read a HF ``config.json`` dict; ``overrides``: run options for both towers."""
        c = _check_model_type(cls, config, "siglip")
        towers = cls._towers_from_hf(c, overrides)
        read = _DUAL_KEYS
        return cls(**towers, hf_extra=_extra(c, read))

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        return self._to_hf({}, architectures)
