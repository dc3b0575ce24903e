"""The system microphone and speakers, through sounddevice (PortAudio).

Each device runs at its own default rate: the microphone's audio is resampled to the 16 kHz the
model hears, and replies (24 kHz) to the speakers' rate. Capture and playback run in PortAudio's
callback threads; the callbacks only move samples through queues, never wait on the model. No
PortAudio library, or no input or output device, is an `AudioDeviceError` saying which.
"""

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import soxr

from omni_local.errors import OmniLocalError
from omni_local.media import SAMPLE_RATE
from omni_local.protocol.events import SPEECH_SAMPLE_RATE


class AudioDeviceError(OmniLocalError):
    pass


def load_sounddevice() -> Any:
    try:
        import sounddevice
    except OSError as error:  # raised at import when the PortAudio library is missing
        raise AudioDeviceError(
            f"no audio devices: the PortAudio library is missing ({error}); install it (Debian: libportaudio2)"
        ) from None
    return sounddevice


class _Stream:
    """A device whose PortAudio stream runs while the `with` block does."""

    _stream: Any

    def __enter__(self) -> "_Stream":
        self._stream.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.stop()
        self._stream.close()


class Microphone(_Stream):
    """The default input device; `on_audio` gets 16 kHz mono float32 samples as they come, on a
    thread of its own: what it does (detect speech, start a turn) never holds up the capture."""

    def __init__(self, sounddevice: Any, on_audio: Callable[[np.ndarray], None]) -> None:
        self._on_audio = on_audio
        self._captured_audio: queue.Queue[np.ndarray | None] = queue.Queue()
        self._listener = threading.Thread(target=self._listen, name="omni-microphone", daemon=True)
        try:
            rate = int(sounddevice.query_devices(kind="input")["default_samplerate"])
            self._stream = sounddevice.InputStream(samplerate=rate, channels=1, dtype="float32",
                                                   callback=self._captured)
        except (sounddevice.PortAudioError, ValueError) as error:
            raise AudioDeviceError(f"no microphone to listen with: {error}") from None
        self._resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32")

    def _captured(self, data: np.ndarray, frames: int, time: Any, status: Any) -> None:
        self._captured_audio.put(data[:, 0].copy())  # PortAudio's thread: hand over and return

    def _listen(self) -> None:
        while (samples := self._captured_audio.get()) is not None:
            self._on_audio(self._resampler.resample_chunk(samples))

    def __enter__(self) -> "Microphone":
        self._listener.start()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._captured_audio.put(None)
        self._listener.join()


class Speakers(_Stream):
    """The default output device, playing a reply's chunks (24 kHz) in order; `stop()` drops what is
    queued."""

    def __init__(self, sounddevice: Any, source_rate: int = SPEECH_SAMPLE_RATE) -> None:
        try:
            self.rate = int(sounddevice.query_devices(kind="output")["default_samplerate"])
            self._stream = sounddevice.OutputStream(samplerate=self.rate, channels=1, dtype="float32",
                                                    callback=self._fill)
        except (sounddevice.PortAudioError, ValueError) as error:
            raise AudioDeviceError(f"no speakers to play on: {error}") from None
        self._source_rate = source_rate
        # One resampler across a reply's chunks: each chunk alone would be cut off at its edges.
        self._resampler = self._new_resampler()
        self._queue: queue.Queue[np.ndarray] = queue.Queue()
        self._current = np.zeros(0, np.float32)
        self._lock = threading.Lock()

    def _new_resampler(self) -> soxr.ResampleStream:
        return soxr.ResampleStream(self._source_rate, self.rate, 1, dtype="float32")

    def play(self, samples: np.ndarray) -> None:
        self._queue.put(self._resampler.resample_chunk(samples.astype(np.float32, copy=False)))

    def finish(self) -> None:
        """The reply is complete: play what the resampler still holds (its last few ms), and resample
        the next reply as a new stream."""
        self._queue.put(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        self._resampler = self._new_resampler()

    def stop(self) -> None:
        with self._lock:
            self._resampler = self._new_resampler()
            self._current = np.zeros(0, np.float32)
            while not self._queue.empty():
                self._queue.get_nowait()

    @property
    def playing(self) -> bool:
        return bool(self._current.size) or not self._queue.empty()

    def _fill(self, out: np.ndarray, frames: int, time: Any, status: Any) -> None:
        with self._lock:
            filled = 0
            while filled < frames:
                if not self._current.size:
                    try:
                        self._current = self._queue.get_nowait()
                    except queue.Empty:
                        break
                take = min(frames - filled, self._current.size)
                out[filled : filled + take, 0] = self._current[:take]
                self._current = self._current[take:]
                filled += take
            out[filled:, 0] = 0.0
