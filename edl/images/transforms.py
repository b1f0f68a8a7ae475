"""The steps of CLIP / SigLIP preprocessing as pure functions over numpy arrays: each is
transformers' Pillow-backend operation (``transformers.image_transforms``), computed the same
way so the results are equal, not close. Images are ``(channels, height, width)`` arrays
after :func:`channels_first`. Pillow is imported on first use (the ``edl-jax[vision]`` extra)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Float32, Shaped

__all__ = [
    "ImageLike",
    "center_crop",
    "channels_first",
    "check_image",
    "normalize",
    "rescale",
    "resize",
    "shortest_edge_size",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
"""Pillow's filters by ``resample`` code (``PIL.Image.Resampling``), the ones transformers
accepts."""

ImageLike = Any
"""A ``PIL.Image.Image`` or a 3-D numpy array, ``(height, width, channels)`` or
``(channels, height, width)``; typed loosely so Pillow stays unimported until used."""


def _pillow() -> Any:
    """``PIL.Image``, or an ImportError naming the extra that installs it."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("edl.images needs Pillow: pip install 'edl-jax[vision]'") from e
    return Image


def _channel_axis(shape: tuple[int, ...]) -> int:
    """0 or 2: the channel axis of an image array of ``shape``, as transformers infers it (a
    dimension of 1, 3 or 4; the first when both are)."""
    if shape[0] in (1, 3, 4):
        return 0
    if shape[2] in (1, 3, 4):
        return 2
    raise ValueError(
        f"edl.images: cannot tell the channel axis of an image of shape {shape}: neither the "
        "first nor the last dimension is 1, 3 or 4 (channels)"
    )


_PIXEL_KINDS = "uif"  # unsigned and signed integers, floats: dtypes whose values are intensities


def check_image(image: ImageLike) -> None:
    """Refuse what is not an image :func:`channels_first` can read, naming its shape and
    dtype: ``TypeError`` for anything but a ``PIL.Image.Image`` or a numpy array;
    ``ValueError`` for a PIL image of zero width or height, an array that is not 3-D, has a
    zero dimension, has no channel axis (see :func:`_channel_axis`) or whose dtype holds no
    intensities: object, string and complex arrays, and bool ones (transformers would read
    True as 1 of 255, a PIL mode ``"1"`` image as 255: ambiguous, so convert a mask first).
    """
    if isinstance(image, np.ndarray):
        if image.ndim != 3:
            raise ValueError(
                f"edl.images: an image array must be 3-D, (height, width, channels) or "
                f"(channels, height, width), got shape {image.shape}"
            )
        if image.dtype.kind not in _PIXEL_KINDS:
            hint = " (a mask: mask.astype(np.uint8) * 255)" if image.dtype.kind == "b" else ""
            raise ValueError(
                f"edl.images: an image array of dtype {image.dtype} (shape {image.shape}) holds "
                f"no pixel intensities: pass unsigned or signed integers or floats{hint}"
            )
        if 0 in image.shape:
            raise ValueError(
                f"edl.images: an image array of shape {image.shape} ({image.dtype}) has no "
                "pixels: a dimension is 0"
            )
        _channel_axis(image.shape)
        return
    pil = _pillow()
    if not isinstance(image, pil.Image):
        raise TypeError(
            "edl.images: an image is a PIL.Image.Image or a numpy array, "
            f"got {type(image).__name__}"
        )
    if image.width == 0 or image.height == 0:
        raise ValueError(
            f"edl.images: a PIL image of {image.width}x{image.height} pixels (width x height, "
            f"mode {image.mode}) has no pixels"
        )


def _rgb_array(image: np.ndarray) -> np.ndarray:
    """transformers' RGB conversion of an array ``(height, width, channels)``: one channel
    repeated, RGBA composited onto white (rounded for integers), others unchanged."""
    channels = image.shape[-1]
    if channels == 1:
        return np.repeat(image, 3, axis=-1)
    if channels != 4:
        return image
    if np.issubdtype(image.dtype, np.floating) and (image.min() < 0.0 or image.max() > 1.0):
        raise ValueError(
            "edl.images: a float RGBA image must hold values in [0, 1] to be composited onto "
            f"white, got [{image.min()}, {image.max()}]"
        )
    white = 255 if np.issubdtype(image.dtype, np.integer) else 1.0
    alpha = image[..., 3:4] / white
    composite = alpha * image[..., :3] + (1 - alpha) * white
    return (
        np.round(composite).astype(image.dtype) if white == 255 else composite.astype(image.dtype)
    )


def channels_first(image: ImageLike, *, convert_rgb: bool = True) -> Shaped[np.ndarray, "c h w"]:
    """``image`` as an array ``(channels, height, width)`` of its own dtype (``uint8`` from
    Pillow).

    With ``convert_rgb``, RGB: a PIL image by Pillow (transparency, from an alpha band or a
    palette's ``transparency``, composited onto white; CMYK, palette and grayscale modes
    converted), an array by repeating one channel or compositing four. Without it, a PIL
    image keeps its bands (``L`` and ``P`` give one channel: palette indices). An array's
    channel axis is inferred as transformers does (see :func:`_channel_axis`); a 2-D array
    is refused, as there (add the channel axis). Inputs are checked by :func:`check_image`.
    """
    check_image(image)
    if isinstance(image, np.ndarray):
        axis = _channel_axis(image.shape)
        hwc = np.moveaxis(image, axis, -1)
        if convert_rgb:
            hwc = _rgb_array(hwc)
        return np.moveaxis(hwc, -1, 0)
    pil = _pillow()
    if convert_rgb:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = pil.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = pil.alpha_composite(white, rgba)
        image = image.convert("RGB")
    array = np.array(image)
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def _pil_scaled(image: np.ndarray) -> bool:
    """Whether an image must be scaled by 255 to become ``uint8`` for Pillow: transformers'
    rule (``uint8`` and integral values in 0..255 are not; other values in [0, 1] are)."""
    if image.dtype == np.uint8:
        return False
    if np.allclose(image, image.astype(int)):
        if np.all(image >= 0) and np.all(image <= 255):
            return False
        raise ValueError(
            "edl.images: an image of integral values must lie in 0..255 to become uint8, got "
            f"[{image.min()}, {image.max()}]"
        )
    if np.all(image >= 0) and np.all(image <= 1):
        return True
    raise ValueError(
        "edl.images: an image of float values must lie in [0, 1] (or be integral in 0..255), "
        f"got [{image.min()}, {image.max()}]"
    )


def rescale(image: Shaped[np.ndarray, "*dims"], factor: float) -> Float32[np.ndarray, "*dims"]:
    """``image * factor`` as float32, multiplied in float64 (as transformers does)."""
    return (image.astype(np.float64) * factor).astype(np.float32)


def resize(
    image: Shaped[np.ndarray, "c h w"], height: int, width: int, resample: int = 3
) -> Shaped[np.ndarray, "c new_h new_w"]:
    """``image`` resized by Pillow's ``resample`` filter (:data:`RESAMPLE`) to ``(channels,
    height, width)``.

    Pillow resizes ``uint8`` images of 1 (``L``), 2 (``LA``), 3 (``RGB``) or 4 (``RGBA``,
    with premultiplied alpha) channels. A ``uint8`` image comes back ``uint8``; other arrays
    are converted as transformers does: integral values in 0..255 cast (the result is
    ``uint8``), float values in [0, 1] scaled by 255 and truncated, and the result scaled
    back (float32).
    """
    scaled = _pil_scaled(image)
    hwc = np.moveaxis(image, 0, -1)
    if hwc.shape[-1] == 1:
        hwc = hwc[..., 0]
    if scaled:
        hwc = rescale(hwc, 255.0)
    pil = _pillow().fromarray(hwc.astype(np.uint8))
    out = np.array(pil.resize((width, height), resample=resample))
    out = np.moveaxis(out[..., None] if out.ndim == 2 else out, -1, 0)
    return rescale(out, 1 / 255) if scaled else out


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """``(height, width)`` of an image resized so its shorter side is ``shortest_edge``: the
    longer side ``int(shortest_edge * long / short)`` (truncated, as transformers and
    torchvision compute it)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def center_crop(
    image: Shaped[np.ndarray, "c h w"], height: int, width: int
) -> Shaped[np.ndarray, "c new_h new_w"]:
    """The central ``(height, width)`` window of ``image``, zero-padded where the image is
    smaller (transformers' rule: the crop starts ``(size - crop) // 2`` in, the padding puts
    the odd pixel at the end)."""
    channels, orig_h, orig_w = image.shape
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return image[:, top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros_like(image, shape=(channels, new_h, new_w))
    top_pad, left_pad = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[:, top_pad : top_pad + orig_h, left_pad : left_pad + orig_w] = image
    top, left = top + top_pad, left + left_pad
    return padded[
        :, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)
    ]


def normalize(
    image: Shaped[np.ndarray, "c h w"], mean: float | Sequence[float], std: float | Sequence[float]
) -> Shaped[np.ndarray, "c h w"]:
    """``(image - mean) / std`` per channel, in the image's float dtype (float32 for
    integers), as transformers computes it. A single number applies to every channel."""
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    channels = image.shape[0]
    stats = []
    for name, value in (("image_mean", mean), ("image_std", std)):
        values = [value] * channels if isinstance(value, int | float) else list(value)
        if len(values) != channels:
            raise ValueError(
                f"edl.images: {name} has {len(values)} values for an image of {channels} channels"
            )
        stats.append(np.array(values, dtype=image.dtype)[:, None, None])
    return (image - stats[0]) / stats[1]
