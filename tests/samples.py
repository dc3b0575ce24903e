"""Deterministic media for the tests: noise pictures and noise clips, one per seed."""

import numpy as np
from PIL import Image


def picture(seed: int, size: tuple[int, int] = (160, 120)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def clip(seed: int, seconds: float = 1.5) -> np.ndarray:
    """`seconds` of 16 kHz mono noise, float32."""
    return (np.random.default_rng(seed).standard_normal(int(16_000 * seconds)) * 0.1).astype(np.float32)
