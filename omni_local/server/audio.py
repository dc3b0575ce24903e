"""A non-streamed spoken reply as a WAV file in base64; streamed, and where a reply asks for it, its
samples go as base64 PCM16 (media/pcm16.py's `base64_pcm16`): mono, 24 kHz, what Code2Wav makes."""

import base64
import io

import numpy as np
import soundfile

from omni_local.media.pcm16 import to_pcm16
from omni_local.protocol.events import SPEECH_SAMPLE_RATE


def base64_wav(samples: np.ndarray) -> str:
    file = io.BytesIO()
    soundfile.write(file, to_pcm16(samples), SPEECH_SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return base64.b64encode(file.getvalue()).decode("ascii")
