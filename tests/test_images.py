"""edl.images against transformers' CLIP and SigLIP image processors (their Pillow backends,
``CLIPImageProcessorPil`` / ``SiglipImageProcessorPil``) on images made here.

Tolerance: none, pixel values must be equal. Both sides hand Pillow the same ``uint8`` image
for the same resize, then do the same numpy operations in the same dtypes and order (rescale
in float64 cast to float32, normalise in float32), so any difference is a bug, not rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.siglip.image_processing_pil_siglip import (  # noqa: E402
    SiglipImageProcessorPil,
)

from edl.images import ImageProcessor, resize  # noqa: E402
from edl.images.processor import CONFIG_NAME, PROCESSOR_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _images() -> dict[str, object]:
    """Every input kind the processors take, at real and tiny sizes."""
    rng = np.random.default_rng(0)

    def noise(h: int, w: int, c: int = 3) -> np.ndarray:
        return rng.integers(0, 256, (h, w, c), dtype=np.uint8)

    y, x = np.mgrid[0:517, 0:333]
    gradient = np.stack([x * 255 // 332, y * 255 // 516, (x + y) * 255 // 848], -1)
    palette_alpha = PIL_Image.fromarray(noise(64, 80)).convert("P")
    palette_alpha.info["transparency"] = palette_alpha.getpixel((0, 0))  # drawn transparent
    return {
        "rgb 640x480": PIL_Image.fromarray(noise(480, 640)),
        "gradient 333x517": PIL_Image.fromarray(gradient.astype(np.uint8)),
        "tiny 20x30": PIL_Image.fromarray(noise(30, 20)),
        "RGBA": PIL_Image.fromarray(noise(100, 150, 4), "RGBA"),
        "L": PIL_Image.fromarray(noise(90, 70, 1)[..., 0], "L"),
        "LA": PIL_Image.fromarray(noise(50, 40, 2), "LA"),
        "P": PIL_Image.fromarray(noise(64, 80)).convert("P"),
        "P transparency": palette_alpha,
        "CMYK": PIL_Image.fromarray(noise(50, 40, 4), "CMYK"),
        "HWC uint8": noise(300, 200),
        "CHW uint8": np.ascontiguousarray(np.moveaxis(noise(300, 200), -1, 0)),
        "HWC RGBA uint8": noise(60, 61, 4),
        "HWC gray uint8": noise(60, 61, 1),
        "float64 [0, 1]": rng.random((120, 90, 3)),
        "float32 [0, 1]": rng.random((120, 90, 3)).astype(np.float32),
        "float RGBA [0, 1]": rng.random((40, 50, 4)),
        "float integral": noise(40, 50).astype(np.float64),
    }


IMAGES = _images()

# (ours, transformers' class, settings for both)
CONFIGS = {
    "clip": (ImageProcessor.clip, CLIPImageProcessorPil, {}),
    "siglip": (ImageProcessor.siglip, SiglipImageProcessorPil, {}),
    "clip 336, odd crop": (
        ImageProcessor.clip,
        CLIPImageProcessorPil,
        {"size": {"shortest_edge": 336}, "crop_size": {"height": 300, "width": 301}},
    ),
    "clip fixed size, no crop": (
        ImageProcessor.clip,
        CLIPImageProcessorPil,
        {"size": {"height": 100, "width": 77}, "do_center_crop": False},
    ),
    "siglip 384x383 bilinear, own mean/std": (
        ImageProcessor.siglip,
        SiglipImageProcessorPil,
        {
            "size": {"height": 384, "width": 383},
            "resample": 2,
            "image_mean": [0.1, 0.2, 0.3],
            "image_std": [0.3, 0.2, 0.1],
        },
    ),
    "siglip, crop padding the height": (
        ImageProcessor.siglip,
        SiglipImageProcessorPil,
        {"do_center_crop": True, "crop_size": {"height": 500, "width": 31}},
    ),
    "clip no resize, crop pads or cuts": (
        ImageProcessor.clip,
        CLIPImageProcessorPil,
        {"do_resize": False, "crop_size": {"height": 101, "width": 99}},
    ),
    "clip no rescale": (ImageProcessor.clip, CLIPImageProcessorPil, {"do_rescale": False}),
    "clip raw pixels": (
        ImageProcessor.clip,
        CLIPImageProcessorPil,
        {"do_rescale": False, "do_normalize": False},
    ),
    "clip no RGB, scalar mean/std": (
        ImageProcessor.clip,
        CLIPImageProcessorPil,
        {"do_convert_rgb": False, "image_mean": 0.5, "image_std": 0.25, "resample": 1},
    ),
}


def _same(ours: np.ndarray, theirs: object) -> None:
    theirs = np.asarray(theirs)
    assert ours.dtype == np.float32
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


@pytest.mark.parametrize("config", CONFIGS)
def test_pixel_values_equal_transformers(config):
    make, reference_cls, settings = CONFIGS[config]
    ours, reference = make(**settings), reference_cls(**settings)
    for name, image in IMAGES.items():
        theirs = reference(image)["pixel_values"][0]
        assert ours.output_size(*_hw(image)) == theirs.shape[1:], name
        _same(ours.process(image), theirs)


def _hw(image: object) -> tuple[int, int]:
    if isinstance(image, np.ndarray):
        return image.shape[1:] if image.shape[0] in (1, 3, 4) else image.shape[:2]
    return image.height, image.width


def test_batches_of_mixed_sizes_and_4d_arrays_equal_transformers():
    ours, reference = ImageProcessor.clip(), CLIPImageProcessorPil()
    batch = [IMAGES["rgb 640x480"], IMAGES["tiny 20x30"], IMAGES["HWC uint8"], IMAGES["P"]]
    pixels = ours(batch)
    assert pixels.shape == (4, 3, 224, 224)
    _same(pixels, reference(batch, return_tensors="np")["pixel_values"])
    _same(ours(tuple(batch)), pixels)
    stacked = np.stack([IMAGES["HWC uint8"], IMAGES["HWC uint8"][::-1]])  # (2, 300, 200, 3)
    _same(ours(stacked), reference(stacked, return_tensors="np")["pixel_values"])
    _same(ours(IMAGES["L"]), reference(IMAGES["L"], return_tensors="np")["pixel_values"])


def test_a_batch_that_does_not_stack_is_refused_and_each_image_matches():
    ours = ImageProcessor.clip(do_center_crop=False)
    batch = [IMAGES["rgb 640x480"], IMAGES["gradient 333x517"]]
    with pytest.raises(ValueError, match=r"different shapes \[\(3, 224, 298\), \(3, 347, 224\)\]"):
        ours(batch)
    for image, theirs in zip(
        batch, CLIPImageProcessorPil(do_center_crop=False)(batch)["pixel_values"], strict=True
    ):
        _same(ours.process(image), theirs)


def test_bad_images_are_refused_where_transformers_refuses_them():
    clip, no_rgb = ImageProcessor.clip(), ImageProcessor.clip(do_convert_rgb=False)
    cases = [  # (ours, transformers', image, their error, ours)
        (
            no_rgb,
            CLIPImageProcessorPil(do_convert_rgb=False),
            IMAGES["RGBA"],
            "mean must have 4 elements",
            "image_mean has 3 values for an image of 4 channels",
        ),
        (
            clip,
            CLIPImageProcessorPil(),
            IMAGES["float64 [0, 1]"] * 2,
            r"outside the range \[0, 1\]",
            r"float values must lie in \[0, 1\]",
        ),
        (
            clip,
            CLIPImageProcessorPil(),
            np.zeros((5, 6, 7), np.uint8),
            "Unable to infer channel dimension",
            r"cannot tell the channel axis.*\(5, 6, 7\)",
        ),
    ]
    for processor, reference, image, theirs, ours in cases:
        with pytest.raises(ValueError, match=theirs):
            reference(image)
        with pytest.raises(ValueError, match=ours):
            processor(image)
    with pytest.raises(ValueError, match=r"must be 3-D.*\(40, 50\)"):
        clip(np.zeros((40, 50), np.uint8))
    with pytest.raises(TypeError, match=r"PIL\.Image\.Image or a numpy array, got str"):
        clip("cat.png")
    with pytest.raises(ValueError, match="no images"):
        clip([])


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (lambda: PIL_Image.new("RGB", (0, 0)), r"a PIL image of 0x0 pixels"),
        (lambda: PIL_Image.new("L", (7, 0)), r"a PIL image of 7x0 pixels .*mode L"),
        (lambda: np.zeros((0, 5, 3), np.uint8), r"shape \(0, 5, 3\) \(uint8\) has no pixels"),
        (lambda: np.zeros((3, 4, 0), np.float32), r"shape \(3, 4, 0\) \(float32\) has no pixels"),
        (lambda: np.zeros((4, 4, 3), object), r"dtype object \(shape \(4, 4, 3\)\)"),
        (lambda: np.full((4, 4, 3), "a"), r"dtype <U1 \(shape \(4, 4, 3\)\)"),
        (lambda: np.zeros((4, 4, 3), complex), r"dtype complex128"),
        (lambda: np.ones((4, 4, 3), bool), r"dtype bool .*mask\.astype\(np\.uint8\) \* 255"),
    ],
)
def test_empty_images_and_non_numeric_arrays_are_refused_by_index(image, message):
    """Refused at the entry, naming the image's place in the batch and its shape or dtype
    (before: ZeroDivisionError in the resize, a TypeError, or pixel values made of objects,
    complex numbers' real parts, or True read as 1 of 255)."""
    clip = ImageProcessor.clip()
    with pytest.raises(ValueError, match=r"ImageProcessor: image 1 of 2: .*" + message):
        clip([IMAGES["tiny 20x30"], image()])
    with pytest.raises(ValueError, match=message):
        clip.process(image())


def test_save_and_from_pretrained_round_trip(tmp_path):
    processor = ImageProcessor.siglip(
        size={"height": 384, "width": 384},
        image_mean=[0.1, 0.2, 0.3],
        resample=2,
        extra={"processor_class": "SiglipProcessor", "image_seq_length": 729},
    )
    processor.save(tmp_path)
    assert ImageProcessor.from_pretrained(tmp_path) == processor
    assert ImageProcessor.from_pretrained(tmp_path / CONFIG_NAME) == processor
    written = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert written["image_seq_length"] == 729 and written["image_mean"] == [0.1, 0.2, 0.3]
    clip = ImageProcessor.clip(do_center_crop=False, image_std=0.3)
    clip.save(tmp_path)  # overwrites
    assert ImageProcessor.from_pretrained(tmp_path) == clip
    assert not [p.name for p in tmp_path.iterdir() if p.name != CONFIG_NAME]  # no temporaries


@pytest.mark.parametrize(
    "config", ["clip", "siglip", "clip 336, odd crop", "siglip 384x383 bilinear, own mean/std"]
)
def test_files_written_by_transformers_and_by_edl_read_alike(tmp_path, config):
    make, reference_cls, settings = CONFIGS[config]
    reference_cls(**settings).save_pretrained(tmp_path / "hf")
    ours = ImageProcessor.from_pretrained(tmp_path / "hf")
    assert ours == make(**settings)
    ours.save(tmp_path / "edl")
    reread = reference_cls.from_pretrained(tmp_path / "edl")
    batch = [IMAGES["rgb 640x480"], IMAGES["gradient 333x517"], IMAGES["tiny 20x30"]]
    pixels = reference_cls.from_pretrained(tmp_path / "hf")(batch, return_tensors="np")
    _same(ours(batch), pixels["pixel_values"])
    _same(ours(batch), reread(batch, return_tensors="np")["pixel_values"])


def test_older_files_read_as_transformers_reads_them(tmp_path):
    """openai/clip-vit-*'s layout (integer sizes, a feature extractor type), a SigLIP file
    with nulls, and transformers 5's processor_config.json, which it reads first."""
    cases = {
        "clip-legacy": {
            "feature_extractor_type": "CLIPFeatureExtractor",
            "size": 256,
            "crop_size": 240,
            "resample": 3,
            "do_center_crop": True,
        },
        "siglip-nulls": {
            "image_processor_type": "SiglipImageProcessor",
            "size": [200, 300],
            "do_center_crop": None,
            "crop_size": None,
            "image_mean": 0.4,
        },
        "square": {
            "image_processor_type": "CLIPImageProcessor",
            "size": 150,
            "default_to_square": True,
        },
    }
    cases["nested"] = cases["clip-legacy"]
    for name, config in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / CONFIG_NAME).write_text(json.dumps(config))
    nested = tmp_path / "nested"  # transformers reads processor_config.json's entry instead
    entry = {"image_processor_type": "CLIPImageProcessor", "crop_size": 128}
    processor = {"processor_class": "CLIPProcessor", "image_processor": entry}
    (nested / PROCESSOR_NAME).write_text(json.dumps(processor))
    batch = [IMAGES["rgb 640x480"], IMAGES["gradient 333x517"]]
    for name in cases:
        cls = SiglipImageProcessorPil if name.startswith("siglip") else CLIPImageProcessorPil
        ours = ImageProcessor.from_pretrained(tmp_path / name)
        theirs = cls.from_pretrained(tmp_path / name)(batch, return_tensors="np")["pixel_values"]
        _same(ours(batch), theirs)
    assert ImageProcessor.from_pretrained(nested).crop_size == {"height": 128, "width": 128}
    # save keeps the two files agreeing: transformers would read the nested entry first
    ImageProcessor.clip(crop_size={"height": 64, "width": 64}).save(nested)
    assert json.loads((nested / PROCESSOR_NAME).read_text())["processor_class"] == "CLIPProcessor"
    assert CLIPImageProcessorPil.from_pretrained(nested).crop_size.height == 64
    assert ImageProcessor.from_pretrained(nested) == ImageProcessor.clip(
        crop_size={"height": 64, "width": 64}
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"image processor config is not valid JSON"),
        (
            '{"image_processor_type": "CLIPImageProcessor", "do_resize": "yes"}',
            r"do_resize must be true or false, got 'yes'",
        ),
        (
            '{"image_processor_type": "CLIPImageProcessor", "resample": 7}',
            r"resample must be one of 0 \(nearest\).*got 7",
        ),
        (
            '{"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 5}}',
            r"size must be .*shortest_edge.*got \{'longest_edge': 5\}",
        ),
        (
            '{"image_processor_type": "CLIPImageProcessor", "size": "big"}',
            r"size must be an integer, \[height, width\] or an object, got 'big'",
        ),
        (
            '{"image_processor_type": "CLIPImageProcessor", '
            '"crop_size": {"height": 0, "width": 2}}',
            r"crop_size must hold positive integers",
        ),
        (
            '{"image_processor_type": "SiglipImageProcessor", "image_mean": ["a"]}',
            r"image_mean must be a number or a list of numbers, got \['a'\]",
        ),
        (
            '{"image_processor_type": "SiglipImageProcessor", "do_center_crop": true}',
            r"do_center_crop needs a crop_size",
        ),
        (
            '{"image_processor_type": "LlavaNextImageProcessor"}',
            r"image_processor_type 'LlavaNextImageProcessor' is not one .* reproduces",
        ),
        (
            '{"image_processor_type": "CLIPImageProcessor", "do_pad": true}',
            r"do_pad=True asks for preprocessing edl does not implement",
        ),
        ('{"size": {"shortest_edge": 224}}', r"names no image_processor_type"),
        ("[1, 2]", r"must hold a JSON object"),
    ],
)
def test_broken_files_name_the_file_and_key(tmp_path, text, message):
    (tmp_path / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        ImageProcessor.from_pretrained(tmp_path)
    assert str(tmp_path / CONFIG_NAME) in str(error.value)


def test_missing_files_and_bad_fields_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        ImageProcessor.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"no {CONFIG_NAME}"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / PROCESSOR_NAME).write_text('{"image_processor": 3}')
    with pytest.raises(ValueError, match=f"{PROCESSOR_NAME}: image_processor must be a JSON"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ImageProcessor: image_std must not hold 0"):
        ImageProcessor.clip(image_std=[0.2, 0.0, 0.2])
    with pytest.raises(ValueError, match=r"extra must not hold the fields \['size'\]"):
        ImageProcessor.clip(extra={"size": 3})
    with pytest.raises(ValueError, match="image_mean has 2 values but image_std 3"):
        ImageProcessor.clip(image_mean=[0.5, 0.5])


def test_pillow_is_imported_only_when_used_and_named_when_missing(monkeypatch):
    code = (
        "import sys, edl, edl.images\n"
        "heavy = [m for m in ('PIL', 'jax', 'transformers', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    monkeypatch.setitem(sys.modules, "PIL", None)  # the extra is not installed
    with pytest.raises(ImportError, match=r"pip install 'edl-jax\[vision\]'"):
        resize(np.zeros((3, 8, 8), np.uint8), 4, 4)
