""":class:`ImageProcessor`: the settings of a ``preprocessor_config.json`` and the pipeline of
:mod:`edl.images.transforms` they select, read and written as transformers does."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float32

from edl.images.transforms import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    RESAMPLE,
    ImageLike,
    center_crop,
    channels_first,
    check_image,
    normalize,
    rescale,
    resize,
    shortest_edge_size,
)

__all__ = ["CONFIG_NAME", "PROCESSOR_NAME", "ImageProcessor"]

CONFIG_NAME = "preprocessor_config.json"
# transformers' processor file: a processor saved by transformers 5 nests the image processor's
# settings in it under "image_processor", and its loader reads those before CONFIG_NAME.
PROCESSOR_NAME = "processor_config.json"


# Image processor types whose preprocessing is edl.images' steps; a type gives only the
# defaults of keys its file leaves out. The Fast (torchvision) names share the settings.
_CLIP_TYPES = ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast")
_SIGLIP_TYPES = ("SiglipImageProcessor", "SiglipImageProcessorPil", "SiglipImageProcessorFast")
# Files older than image processors name a feature extractor instead.
_FEATURE_EXTRACTORS = {"CLIPFeatureExtractor": "CLIPImageProcessor"}

# Keys of preprocessor_config.json that transformers would act on in ways edl does not
# reproduce, with the values that mean "off"; any other value is refused.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "do_pad": (None, False),
    "use_square_size": (None, False),
    "input_data_format": (None,),
    "data_format": (None, "channels_first"),
}


def _check_size(value: Any, key: str) -> dict[str, int]:
    """``value`` as ``{"shortest_edge": n}`` or ``{"height": h, "width": w}`` of positive
    ints (a copy), or a ValueError naming ``key``."""
    if not isinstance(value, Mapping) or set(value) not in ({"shortest_edge"}, {"height", "width"}):
        raise ValueError(
            f'{key} must be {{"shortest_edge": n}} or {{"height": h, "width": w}}, got {value!r}'
            " (transformers' other size forms resize by rules edl does not implement)"
        )
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value.values()):
        raise ValueError(f"{key} must hold positive integers, got {dict(value)!r}")
    return dict(value)


def _check_stats(value: Any, key: str) -> float | tuple[float, ...]:
    """``value`` as a number or a non-empty tuple of numbers, or a ValueError naming ``key``."""
    numbers = value if isinstance(value, list | tuple) else [value]
    if not numbers or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in numbers
    ):
        raise ValueError(f"{key} must be a number or a list of numbers, got {value!r}")
    if key == "image_std" and any(v == 0 for v in numbers):
        raise ValueError(f"image_std must not hold 0 (it divides), got {value!r}")
    return tuple(float(v) for v in value) if isinstance(value, list | tuple) else float(value)


_FIELD_KEYS = (
    "image_processor_type",
    "do_resize",
    "size",
    "resample",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


_DEFAULTS: dict[tuple[str, ...], dict[str, Any]] = {
    _CLIP_TYPES: {
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "do_convert_rgb": True,
    },
    _SIGLIP_TYPES: {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": False,
        "crop_size": None,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGENET_STANDARD_MEAN,
        "image_std": IMAGENET_STANDARD_STD,
        "do_convert_rgb": True,
    },
}
"""transformers' class defaults (``CLIPImageProcessorPil``, ``SiglipImageProcessorPil``)."""


def _defaults(kind: Any) -> dict[str, Any]:
    """A fresh copy of the default fields of image processor type ``kind``."""
    for kinds, defaults in _DEFAULTS.items():
        if kind in kinds:
            return {key: dict(v) if isinstance(v, dict) else v for key, v in defaults.items()}
    supported = ", ".join(kind for kinds in _DEFAULTS for kind in kinds)
    raise ValueError(
        f"image_processor_type {kind!r} is not one whose preprocessing edl reproduces "
        f"(supported: {supported})"
    )


def _validated(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` (:class:`ImageProcessor`'s, by name) checked and normalised: dicts copied,
    numbers as floats, lists of numbers as tuples, a missing ``crop_size`` the type's
    default (transformers' reading of null); a ValueError names the first bad one."""
    defaults = _defaults(fields["image_processor_type"])
    for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
        if not isinstance(fields[key], bool):
            raise ValueError(f"{key} must be true or false, got {fields[key]!r}")
    resample = fields["resample"]
    if isinstance(resample, bool) or resample not in RESAMPLE:
        names = ", ".join(f"{code} ({name})" for code, name in RESAMPLE.items())
        raise ValueError(f"resample must be one of {names}, got {resample!r}")
    factor = fields["rescale_factor"]
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor):
        raise ValueError(f"rescale_factor must be a finite number, got {factor!r}")
    crop = defaults["crop_size"] if fields["crop_size"] is None else fields["crop_size"]
    if crop is not None and (not isinstance(crop, Mapping) or set(crop) != {"height", "width"}):
        raise ValueError(f'crop_size must be {{"height": h, "width": w}}, got {crop!r}')
    if fields["do_center_crop"] and crop is None:
        raise ValueError("do_center_crop needs a crop_size")
    mean = _check_stats(fields["image_mean"], "image_mean")
    std = _check_stats(fields["image_std"], "image_std")
    if isinstance(mean, tuple) and isinstance(std, tuple) and len(mean) != len(std):
        raise ValueError(f"image_mean has {len(mean)} values but image_std {len(std)}")
    extra = fields["extra"]
    if not isinstance(extra, Mapping) or not all(isinstance(key, str) for key in extra):
        raise ValueError(f"extra must be a mapping with string keys, got {extra!r}")
    if clash := sorted(set(extra) & set(_FIELD_KEYS)):
        raise ValueError(f"extra must not hold the fields {clash}")
    for key, allowed in _OFF_VALUES.items():
        if key in extra and extra[key] not in allowed:
            raise ValueError(
                f"{key}={extra[key]!r} asks for preprocessing edl does not implement "
                f"(supported: {' or '.join(map(repr, allowed))})"
            )
    return {
        **fields,
        "size": _check_size(fields["size"], "size"),
        "resample": int(resample),
        "crop_size": None if crop is None else _check_size(crop, "crop_size"),
        "rescale_factor": float(factor),
        "image_mean": mean,
        "image_std": std,
        "extra": dict(extra),
    }


def _size_dict(value: Any, key: str, *, square: bool) -> Any:
    """A size as a file may give it, read as transformers' ``get_size_dict`` does: an int is
    a square (``square``) or a shortest edge, ``[height, width]`` a rectangle; dicts pass
    (checked later)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, list | tuple) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, Mapping):
        return value
    raise ValueError(f"{key} must be an integer, [height, width] or an object, got {value!r}")


def _image_list(images: Any) -> list[Any]:
    """One image or a batch as a list: a 4-D array is a batch (as in transformers), a list or
    tuple holds images, anything else is one image."""
    is_batch = isinstance(images, list | tuple) or (
        isinstance(images, np.ndarray) and images.ndim == 4
    )
    batch = list(images) if is_batch else [images]
    if not batch:
        raise ValueError("ImageProcessor: no images to process (an empty batch)")
    return batch


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing of CLIP / SigLIP vision towers, as ``preprocessor_config.json``
    describes it (the fields are its keys); see the module docstring for the steps.

    Build one with :meth:`clip` / :meth:`siglip` (transformers' defaults for those classes)
    or :meth:`from_pretrained`; call it on images for ``pixel_values``. Fields are checked
    and normalised on construction (``ValueError`` naming the field).

    Attributes:
        image_processor_type: transformers' class name (``CLIPImageProcessor``,
            ``SiglipImageProcessor``, or their ``Pil`` / ``Fast`` variants); it gives the
            defaults of keys a file leaves out.
        do_resize, size: resize to ``{"shortest_edge": n}`` (aspect ratio kept) or
            ``{"height": h, "width": w}``.
        resample: Pillow's filter, a key of :data:`RESAMPLE` (3: bicubic).
        do_center_crop, crop_size: crop the centre ``{"height": h, "width": w}``; None
            means the type's default (CLIP's 224 x 224; SigLIP has none).
        do_rescale, rescale_factor: multiply by ``rescale_factor`` (1 / 255).
        do_normalize, image_mean, image_std: ``(x - mean) / std`` per channel (a number
            applies to every channel).
        do_convert_rgb: convert inputs to RGB first (see :func:`channels_first`).
        extra: the file's other keys (``processor_class``, ``image_seq_length``, ...),
            written back by :meth:`save`.
    """

    # Mappings are stored as dicts (copies), sequences of numbers as tuples of floats.
    image_processor_type: str
    do_resize: bool
    size: Mapping[str, int]
    resample: int
    do_center_crop: bool
    crop_size: Mapping[str, int] | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: float | Sequence[float]
    image_std: float | Sequence[float]
    do_convert_rgb: bool
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            fields = _validated({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except ValueError as e:
            raise ValueError(f"ImageProcessor: {e}") from e
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    @classmethod
    def clip(cls, **changes: Any) -> ImageProcessor:
        """transformers' ``CLIPImageProcessor`` defaults (shortest edge 224, bicubic, centre
        crop 224 x 224, OpenAI's mean and std), with ``changes`` (fields by name)."""
        kind = changes.pop("image_processor_type", "CLIPImageProcessor")
        return cls(image_processor_type=kind, **{**_defaults("CLIPImageProcessor"), **changes})

    @classmethod
    def siglip(cls, **changes: Any) -> ImageProcessor:
        """transformers' ``SiglipImageProcessor`` defaults (224 x 224, the aspect ratio not
        kept, bicubic, no crop, mean and std 0.5), with ``changes`` (fields by name)."""
        kind = changes.pop("image_processor_type", "SiglipImageProcessor")
        return cls(image_processor_type=kind, **{**_defaults("SiglipImageProcessor"), **changes})

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any], *, source: str = "image processor config"
    ) -> ImageProcessor:
        """The processor a ``preprocessor_config.json`` object describes, read as
        transformers reads it: keys it leaves out (or sets to null) take the defaults of its
        ``image_processor_type`` (in older files, ``feature_extractor_type``); an integer
        ``size`` is a shortest edge (a square with ``"default_to_square": true``), an integer
        ``crop_size`` a square, a ``[height, width]`` list either; other keys go to ``extra``.

        ``ValueError`` (starting with ``source``) names a bad key and value, a type edl does
        not reproduce, or settings whose preprocessing edl does not implement (padding,
        transformers' other size rules).
        """
        try:
            kind = config.get("image_processor_type")
            if kind is None:
                extractor = config.get("feature_extractor_type")
                kind = _FEATURE_EXTRACTORS.get(extractor) if isinstance(extractor, str) else None
            if kind is None:
                raise ValueError(
                    "names no image_processor_type (nor a feature_extractor_type edl knows: "
                    f"{', '.join(_FEATURE_EXTRACTORS)}); build it with ImageProcessor.clip(...) "
                    "or ImageProcessor.siglip(...)"
                )
            fields = {"image_processor_type": kind, **_defaults(kind), "extra": {}}
            square = config.get("default_to_square") is True
            for key, value in config.items():
                if key not in _FIELD_KEYS:
                    fields["extra"][key] = value
                elif key in ("size", "crop_size") and value is not None:
                    fields[key] = _size_dict(value, key, square=square or key == "crop_size")
                elif value is not None:
                    fields[key] = value
            return cls(**_validated(fields))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """The processor of a local model directory (or of a ``preprocessor_config.json``
        path), read as transformers does: the ``image_processor`` entry of
        ``processor_config.json`` when there is one, else ``preprocessor_config.json``; see
        :meth:`from_dict`. Errors name the file. (A hub repo: download it first, e.g. with
        ``huggingface_hub.snapshot_download``.)"""
        path = Path(path)
        if path.is_file():
            return cls.from_dict(_read_config(path), source=str(path))
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory")
        nested = _nested_config(path / PROCESSOR_NAME)
        if nested is not None:
            return cls.from_dict(nested, source=f"{path / PROCESSOR_NAME} (image_processor)")
        file = path / CONFIG_NAME
        if not file.is_file():
            raise FileNotFoundError(
                f"{path}: no {CONFIG_NAME} (nor an image_processor entry in {PROCESSOR_NAME})"
            )
        return cls.from_dict(_read_config(file), source=str(file))

    def to_dict(self) -> dict[str, Any]:
        """The ``preprocessor_config.json`` object: the fields (no ``crop_size`` when None),
        then the ``extra`` keys."""
        config: dict[str, Any] = {key: getattr(self, key) for key in _FIELD_KEYS}
        for key in ("image_mean", "image_std"):
            config[key] = list(config[key]) if isinstance(config[key], tuple) else config[key]
        if config["crop_size"] is None:
            del config["crop_size"]
        return {**config, **self.extra}

    def save(self, directory: str | Path) -> None:
        """Write ``preprocessor_config.json`` into ``directory`` (created if missing),
        atomically; a ``processor_config.json`` there with an ``image_processor`` entry
        (which transformers reads first) gets that entry replaced too."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.to_dict()
        processor_file = directory / PROCESSOR_NAME
        if _nested_config(processor_file) is not None:
            processor = _files().read_json(processor_file, what="processor config")
            _files().write_json_atomic(processor_file, {**processor, "image_processor": config})
        _files().write_json_atomic(directory / CONFIG_NAME, config)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` that :func:`resize` makes of an image of ``height`` x
        ``width`` (``size``: a shortest edge, or a fixed size)."""
        edge = self.size.get("shortest_edge")
        if edge is not None:
            return shortest_edge_size(height, width, edge)
        return self.size["height"], self.size["width"]

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` of the pixel values of an image of ``height`` x ``width``."""
        if self.do_resize:
            height, width = self.resized_size(height, width)
        if self.do_center_crop and self.crop_size is not None:
            height, width = self.crop_size["height"], self.crop_size["width"]
        return height, width

    def process(self, image: ImageLike) -> Float32[np.ndarray, "channels height width"]:
        """One image's pixel values: :func:`channels_first`, :func:`resize`,
        :func:`center_crop`, :func:`rescale`, :func:`normalize` as the ``do_*`` fields say;
        float32 (``(3, height, width)`` with ``do_convert_rgb``), equal to transformers'
        (which leave ``uint8`` when neither rescaled nor normalised)."""
        array = channels_first(image, convert_rgb=self.do_convert_rgb)
        if self.do_resize:
            array = resize(array, *self.resized_size(*array.shape[1:]), self.resample)
        if self.do_center_crop and self.crop_size is not None:
            array = center_crop(array, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            array = rescale(array, self.rescale_factor)
        if self.do_normalize:
            array = normalize(array, self.image_mean, self.image_std)
        return array.astype(np.float32)

    def __call__(
        self, images: ImageLike | Sequence[ImageLike]
    ) -> Float32[np.ndarray, "batch channels height width"]:
        """``pixel_values`` of one image or a batch (a list or tuple of images, or a 4-D
        array), ``(batch, channels, height, width)`` float32: :meth:`process` of each,
        stacked. Images that come out in different sizes (no centre crop) are a
        ``ValueError``: process those one at a time. Every image is checked first
        (:func:`check_image`: no empty images, no object, string, complex or bool arrays);
        the error names its index in the batch."""
        batch = _image_list(images)
        for index, image in enumerate(batch):
            try:
                check_image(image)
            except (TypeError, ValueError) as e:
                raise type(e)(f"ImageProcessor: image {index} of {len(batch)}: {e}") from e
        arrays = [self.process(image) for image in batch]
        shapes = sorted({array.shape for array in arrays})
        if len(shapes) > 1:
            raise ValueError(
                f"ImageProcessor: the images come out in different shapes {shapes} (no centre "
                "crop to one size), so they do not stack: call .process on each"
            )
        return np.stack(arrays)


def _files() -> Any:
    """``edl.io.formats.files`` (JSON read with errors naming the file, atomic writes),
    imported when a file is read or written: importing the ``edl.io`` package imports jax,
    which preprocessing never needs."""
    from edl.io.formats import files

    return files


def _read_config(file: Path) -> dict[str, Any]:
    """The JSON object in ``file`` (errors name it)."""
    return _files().read_json(file, what="image processor config")


def _nested_config(processor_file: Path) -> dict[str, Any] | None:
    """The ``image_processor`` object of a ``processor_config.json``, or None (no file, no
    entry); an entry that is not an object is a ValueError naming the file."""
    if not processor_file.is_file():
        return None
    nested = _files().read_json(processor_file, what="processor config").get("image_processor")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"{processor_file}: image_processor must be a JSON object, got {nested!r}")
    return nested
