"""Input images for the tests: structured pictures (random noise pictures look alike to a VAE, so
another image would barely move the output) and their encoded files."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def picture(seed: int, height: int = 64, width: int = 80) -> np.ndarray:
    """RGB gradients ``[height, width, 3]`` uint8, offset per seed."""
    y, x = np.mgrid[0:height, 0:width]
    offset = np.random.default_rng(seed).random(3) * 255
    channels = [(x * 3 + offset[0]) % 256, (y * 4 + offset[1]) % 256, ((x + y) * 2 + offset[2]) % 256]
    return np.stack(channels, -1).astype(np.uint8)


def encoded(image: Image.Image | np.ndarray, format: str = "PNG", **options) -> bytes:
    """``image`` as a file's bytes."""
    image = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


def png(seed: int, height: int = 64, width: int = 80) -> bytes:
    return encoded(picture(seed, height, width))
