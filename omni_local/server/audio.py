"""Spoken replies on the wire: 16-bit signed little-endian PCM, mono, 24 kHz (what Code2Wav makes),
as base64; a non-streamed reply may ask for the same samples as a WAV file instead."""

import base64
import io

import numpy as np
import soundfile

from omni_local.api.events import SPEECH_SAMPLE_RATE


def pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] as int16; a sample beyond the range is clipped, not wrapped."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")


def base64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16(samples).tobytes()).decode("ascii")


def base64_wav(samples: np.ndarray) -> str:
    file = io.BytesIO()
    soundfile.write(file, pcm16(samples), SPEECH_SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return base64.b64encode(file.getvalue()).decode("ascii")
