"""Spoken replies on the wire: 16-bit signed little-endian PCM, mono, 24 kHz (what Code2Wav makes),
as base64; a non-streamed reply may ask for the same samples as a WAV file instead."""

import base64
import io

import numpy as np
import soundfile

from omni_local.api.events import SPEECH_SAMPLE_RATE
from omni_local.media.pcm16 import to_pcm16


def base64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")


def base64_wav(samples: np.ndarray) -> str:
    file = io.BytesIO()
    soundfile.write(file, to_pcm16(samples), SPEECH_SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return base64.b64encode(file.getvalue()).decode("ascii")
