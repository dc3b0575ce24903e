"""Samples as 16-bit signed little-endian PCM, the form speech travels in (to the page's player, in
the API's streamed audio, back from a remote server): one scale both ways, so a round trip changes a
sample by at most half a step."""

import base64

import numpy as np

_SCALE = 32767  # full scale: 1.0 is 32767, -1.0 is -32767


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] as int16, rounded; a sample beyond the range is clipped, not wrapped."""
    return np.round(np.clip(samples, -1.0, 1.0) * _SCALE).astype("<i2")


def from_pcm16(data: bytes) -> np.ndarray:
    """PCM16 bytes (an even number) as float32 samples."""
    return np.frombuffer(data, "<i2").astype(np.float32) / _SCALE


def base64_pcm16(samples: np.ndarray) -> str:
    """`to_pcm16`'s bytes in base64, as JSON carries them."""
    return base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")
