"""A realtime session's input audio buffer, and server VAD over it.

The client sends PCM16 at 24 kHz; the model and Silero VAD take 16 kHz, so the stream is resampled
as it comes (one soxr stream, so pieces join without clicks) and kept at 16 kHz until it is
committed or cleared. With server VAD on, the stream is fed to voice.py's `SpeechDetector` one VAD
step (512 samples) at a time, so each start and stop is placed to the step: `audio_start_ms` and
`audio_end_ms` count from the session's first sample, as OpenAI's do. A stop commits the utterance
the detector cut (with its `prefix_padding_ms` of audio from before the start), not the whole buffer.

The buffer holds at most `max_audio_seconds`. Without VAD an append past that is refused (the
client commits or clears); with VAD the oldest audio goes instead, since a session that listens
through minutes of silence commits nothing.
"""

import base64
import binascii
from collections import deque
from dataclasses import dataclass

import numpy as np
import soxr

from omni_local.media import SAMPLE_RATE
from omni_local.media.pcm16 import from_pcm16
from omni_local.protocol.events import SPEECH_SAMPLE_RATE
from omni_local.server.realtime.client_events import EventError, ServerVad
from omni_local.voice import CHUNK, SpeechDetector, SpeechStarted

MIN_COMMIT_MS = 100  # as OpenAI: a shorter buffer is refused on commit


@dataclass(frozen=True)
class SpeechStart:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStop:
    audio_end_ms: int
    samples: np.ndarray  # the utterance: 16 kHz mono float32


def decode_pcm16(data: str, param: str = "audio") -> np.ndarray:
    """Base64 PCM16 as float32 samples; bad base64 or an odd number of bytes is an `EventError`."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError(f"{param} is not valid base64", "invalid_base64", param) from None
    if len(raw) % 2:
        raise EventError(f"{param} holds {len(raw)} bytes: PCM16 samples are 2 bytes each", param=param)
    return from_pcm16(raw)


def to_16k(samples: np.ndarray) -> np.ndarray:
    """A whole clip at 24 kHz resampled to 16 kHz."""
    return soxr.resample(samples, SPEECH_SAMPLE_RATE, SAMPLE_RATE).astype(np.float32)


class InputAudio:
    def __init__(self, vad: ServerVad | None, max_seconds: float) -> None:
        self.max_samples = int(max_seconds * SAMPLE_RATE)
        self._resampler = soxr.ResampleStream(SPEECH_SAMPLE_RATE, SAMPLE_RATE, 1, dtype="float32")
        self._buffer: deque[np.ndarray] = deque()  # 16 kHz, since the last commit or clear
        self._held = 0  # samples in the buffer
        self._unstepped = np.zeros(0, np.float32)  # resampled, not yet fed to the detector
        self._stepped = 0  # 16 kHz samples fed to the detector, in all
        self.detector = self._detector(vad)

    @staticmethod
    def _detector(vad: ServerVad | None) -> SpeechDetector | None:
        if vad is None:
            return None
        return SpeechDetector(vad.silence_duration_ms, vad.prefix_padding_ms, vad.threshold)

    def detect(self, vad: ServerVad | None) -> None:
        """Turn detection as the session now has it: a new detector, or none."""
        self.detector = self._detector(vad)

    def append(self, samples: np.ndarray) -> list[SpeechStart | SpeechStop]:
        """24 kHz samples in; the starts and stops of speech they complete."""
        incoming = len(samples) * SAMPLE_RATE // SPEECH_SAMPLE_RATE
        if self.detector is None and self._held + incoming > self.max_samples:
            raise EventError(f"the input audio buffer would hold more than {self.max_samples // SAMPLE_RATE} s "
                             "(max_audio_seconds): commit or clear it", "input_audio_buffer_full")
        resampled = self._resampler.resample_chunk(samples)
        self._keep(resampled)
        if self.detector is None:
            self._stepped += len(resampled)
            return []
        self._unstepped = np.concatenate([self._unstepped, resampled])
        found: list[SpeechStart | SpeechStop] = []
        while len(self._unstepped) >= CHUNK:
            step, self._unstepped = self._unstepped[:CHUNK], self._unstepped[CHUNK:]
            self._stepped += CHUNK
            for event in self.detector.feed(step):
                found.append(SpeechStart(self._ms()) if isinstance(event, SpeechStarted)
                             else SpeechStop(self._ms(), event.samples))
        if any(isinstance(event, SpeechStop) for event in found):
            self._clear_buffer()
            self._keep(self._unstepped.copy())  # what follows the utterance stays for the next
        return found

    def _keep(self, piece: np.ndarray) -> None:
        self._buffer.append(piece)
        self._held += len(piece)
        while self.detector is not None and self._held > self.max_samples and len(self._buffer) > 1:
            self._held -= len(self._buffer.popleft())

    def take(self) -> np.ndarray:
        """The buffer, committed by the client (with the resampler's last few ms): emptied."""
        self._keep(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        self._resampler.clear()
        samples = self.samples()
        if len(samples) * 1000 < MIN_COMMIT_MS * SAMPLE_RATE:
            raise EventError(f"the input audio buffer holds {len(samples) * 1000 // SAMPLE_RATE} ms: at least "
                             f"{MIN_COMMIT_MS} ms are needed to commit it", "input_audio_buffer_commit_empty")
        self.clear()
        return samples

    def samples(self) -> np.ndarray:
        return np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.float32)

    def _clear_buffer(self) -> None:
        self._buffer.clear()
        self._held = 0

    def clear(self) -> None:
        """The buffer emptied and the detector's utterance, if one is under way, forgotten."""
        self._clear_buffer()
        if self.detector is not None:
            self.detector.reset()
            self._stepped += len(self._unstepped)
            self._unstepped = np.zeros(0, np.float32)

    def _ms(self) -> int:
        return self._stepped * 1000 // SAMPLE_RATE
