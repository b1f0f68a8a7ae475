"""Image preprocessing for vision encoders (CLIP, SigLIP, LLaVA's towers): numpy and Pillow.

:class:`ImageProcessor` turns images into the ``pixel_values`` a vision tower reads, value for
value as transformers' ``CLIPImageProcessor`` / ``SiglipImageProcessor`` make them with their
Pillow backend (``CLIPImageProcessorPil`` / ``SiglipImageProcessorPil``, the classes
transformers uses when torchvision is absent); its fields are the keys of the model's
``preprocessor_config.json``. Each image goes through the same steps as there:

1. :func:`channels_first`: a ``PIL.Image`` or a 3-D array to ``(channels, height, width)``,
   converted to RGB with transparency composited onto white (``do_convert_rgb``);
2. :func:`resize` with Pillow's filter (``resample``, bicubic for both), to ``size``:
   ``{"shortest_edge": n}`` keeps the aspect ratio (:func:`shortest_edge_size`),
   ``{"height": h, "width": w}`` does not;
3. :func:`center_crop` to ``crop_size``, zero-padded where the image is smaller;
4. :func:`rescale` by ``rescale_factor`` (1 / 255) and :func:`normalize` by ``image_mean``
   and ``image_std``.

transformers' quirks are kept, so the results stay equal: a float array with values in
[0, 1] is scaled to 0..255 and truncated to ``uint8`` for Pillow, and is rescaled by
``rescale_factor`` once more unless ``do_rescale`` is False (pass such arrays with
``do_rescale=False``). transformers' torchvision backend (``CLIPImageProcessorFast``, also
picked for a plain ``CLIPImageProcessor`` where torchvision is installed) resizes with its
own kernels, not Pillow's; edl reproduces the Pillow backend only.

- ``transforms``: the steps as pure functions over numpy arrays;
- ``processor``: :class:`ImageProcessor`, the settings, read from and written to
  ``preprocessor_config.json`` (or a ``processor_config.json``'s ``image_processor``).

No jax: pure numpy, and Pillow (the ``edl-jax[vision]`` extra) imported on first use.
"""

from edl.images.processor import ImageProcessor
from edl.images.transforms import center_crop, channels_first, normalize, rescale, resize

__all__ = ["ImageProcessor", "center_crop", "channels_first", "normalize", "rescale", "resize"]
