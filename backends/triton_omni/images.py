"""Input images, decoded and checked before anything is allocated for them.

A request's images arrive as pixels (``image``: UINT8 ``[H, W, 3]``) or as encoded files
(``images``: PNG, JPEG or WebP bytes, one or several). Every failure is a
``RequestValidationError`` naming the field and the image: an image that cannot be decoded, one
too large in bytes or pixels (the header's size is checked before the pixels are decoded, and
Pillow's own decompression-bomb limit is set to the same bound, never disabled), an animation, a
format or pixel depth the pipelines do not read, more images than the model takes.

What is converted rather than refused, as a diffusers user converts it: palette, grayscale and
CMYK images become RGB; an alpha channel is dropped (``Image.convert("RGB")``), since the
pipelines read three channels.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from triton_omni.errors import RequestValidationError

FORMATS = ("PNG", "JPEG", "WEBP")
CONVERTED_MODES = ("RGB", "RGBA", "RGBX", "P", "PA", "L", "LA", "1", "CMYK", "YCbCr")  # to RGB


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 0  # 0: the model takes no input image
    max_image_bytes: int = 20 * 1024 * 1024  # one encoded file
    max_image_pixels: int = 4096 * 4096  # one image's width x height, decoded
    min_side: int = 1  # each side at least this many pixels (the family's own minimum)


def decode_images(pixels: Any, files: list[bytes] | None, limits: ImageLimits) -> list:
    """The request's images as RGB ``PIL.Image``s (``[]``: none given)."""
    if pixels is None and files is None:
        return []
    if pixels is not None and files is not None:
        raise RequestValidationError("image", "give either `image` (pixels) or `images` (files), not both", None,
                                     show_value=False)
    field = "image" if pixels is not None else "images"
    if limits.max_images == 0:
        raise RequestValidationError(field, "this model takes no input image", None, show_value=False)
    if pixels is not None:
        return [_from_pixels(pixels, limits)]
    if not files:
        raise RequestValidationError("images", "holds no image", 0)
    if len(files) > limits.max_images:
        raise RequestValidationError("images", f"this model takes at most {limits.max_images} images",
                                     len(files))
    return [_from_file(data, index, limits) for index, data in enumerate(files)]


def _from_pixels(pixels: Any, limits: ImageLimits):
    from PIL import Image

    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8:
        raise RequestValidationError("image", "must be UINT8 pixels [height, width, 3]",
                                     str(getattr(pixels, "dtype", type(pixels).__name__)))
    shape = tuple(pixels.shape)
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 3 or shape[2] != 3:
        raise RequestValidationError("image", "must be [height, width, 3] (RGB)", list(pixels.shape))
    _check_size("image", shape[1], shape[0], limits)
    return Image.fromarray(pixels.reshape(shape).cpu().numpy(), mode="RGB")


def _from_file(data: bytes, index: int, limits: ImageLimits):
    from PIL import Image, UnidentifiedImageError

    field = f"images[{index}]"
    if not data:
        raise RequestValidationError(field, "is empty (zero bytes)", 0)
    if len(data) > limits.max_image_bytes:
        raise RequestValidationError(field, f"is larger than {limits.max_image_bytes} bytes", len(data))
    # Pillow refuses (DecompressionBombError) past twice its limit and warns past it: the limit is
    # ours, and the size in the header is checked below before a pixel is decoded
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    try:
        with warnings.catch_warnings():  # between the limit and twice it Pillow only warns: refused below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise RequestValidationError(field, f"has more than {limits.max_image_pixels} pixels", None,
                                     show_value=False) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise RequestValidationError(field, f"is not an image file ({', '.join(FORMATS)})", data[:16]) from None
    if image.format not in FORMATS:
        raise RequestValidationError(field, f"format must be one of {', '.join(FORMATS)}", image.format)
    if getattr(image, "n_frames", 1) > 1:
        raise RequestValidationError(field, "is an animation: send one frame", image.n_frames)
    _check_size(field, *image.size, limits)
    if image.mode not in CONVERTED_MODES:  # 16-bit and floating-point pixels: the pipelines read 8-bit RGB
        raise RequestValidationError(field, "must have 8-bit channels (RGB, grayscale, palette, CMYK; an alpha "
                                     "channel is dropped)", image.mode)
    try:
        image.load()
    except Exception as exc:  # truncated or corrupt data: Pillow raises OSError, SyntaxError and others
        raise RequestValidationError(field, f"could not be decoded ({type(exc).__name__})", None,
                                     show_value=False) from None
    return image.convert("RGB")


def _check_size(field: str, width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_image_pixels:
        raise RequestValidationError(field, f"has more than {limits.max_image_pixels} pixels", f"{width}x{height}")
    if min(width, height) < limits.min_side:
        raise RequestValidationError(field, f"each side must be at least {limits.min_side} pixels",
                                     f"{width}x{height}")
