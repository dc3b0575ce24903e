"""Sound on the wire: a question's samples as a WAV file, and a spoken reply's pieces back as
samples at the rate every backend's `AudioChunk` has (24 kHz mono float32)."""

import base64
import binascii
import io

import numpy as np
import soundfile
import soxr

from omni_local.errors import RequestError
from omni_local.media import SAMPLE_RATE
from omni_local.media.pcm16 import from_pcm16
from omni_local.protocol.events import SPEECH_SAMPLE_RATE

_WAV_MAGIC = b"RIFF"
_NOTHING = np.zeros(0, np.float32)


def wav_base64(samples: np.ndarray) -> str:
    """16 kHz mono float32 samples as a base64 WAV file of float32 samples: lossless, so the server
    hears exactly what the local engine would, and the same clip sent again is the same bytes."""
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SAMPLE_RATE, subtype="FLOAT", format="WAV")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SpeechDecoder:
    """A spoken reply's pieces (base64), one after another, as 24 kHz mono float32 samples.

    A piece is a WAV file (vLLM-Omni's default, at whatever rate its model has) or bare PCM16
    little-endian at 24 kHz (OpenAI's `pcm16`, which we ask for): a WAV file says so in its first
    bytes, bare PCM has no header. WAV pieces at another rate go through one resampler for the whole
    reply, so that no seam clicks where two pieces meet; `flush` gives what it still holds."""

    def __init__(self) -> None:
        self._resampler: soxr.ResampleStream | None = None
        self._rate = SPEECH_SAMPLE_RATE

    def decode(self, payload: str) -> np.ndarray:
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("the server sent audio that is not base64") from None
        if not data.startswith(_WAV_MAGIC):
            return self._at_rate(_pcm16(data), SPEECH_SAMPLE_RATE)
        try:
            samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except RuntimeError:  # libsndfile's errors, for a header it cannot read
            raise RequestError("the server sent a WAV file that cannot be read") from None
        return self._at_rate(samples.mean(axis=1), rate)

    def flush(self) -> np.ndarray:
        """The resampler's last samples, once the reply's pieces have all been decoded."""
        if self._resampler is None:
            return _NOTHING
        rest = self._resampler.resample_chunk(_NOTHING, last=True)
        self._resampler = None
        return rest.astype(np.float32)

    def _at_rate(self, samples: np.ndarray, rate: int) -> np.ndarray:
        held = _NOTHING
        if rate != self._rate:  # pieces at a new rate: what the old resampler holds comes first
            held, self._rate = self.flush(), rate
            if rate != SPEECH_SAMPLE_RATE:
                self._resampler = soxr.ResampleStream(rate, SPEECH_SAMPLE_RATE, 1, dtype="float32")
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(np.ascontiguousarray(samples, np.float32))
        return np.concatenate([held, samples]).astype(np.float32, copy=False)


def _pcm16(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise RequestError("the server sent PCM16 audio of an odd number of bytes")
    return from_pcm16(data)
