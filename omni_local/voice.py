"""Hands-free voice conversation: end of speech starts a turn, speech over a reply stops it.

`SpeechDetector` runs Silero VAD (a small model shipped in its wheel, run on the CPU) over the
microphone's 16 kHz stream, 512 samples at a time, and cuts it into utterances: from a little
before speech starts until `silence_ms` of silence. `VoiceConversation` asks each utterance as a
spoken question and streams the reply's audio to a player; when the person speaks while a reply is
being made or played (barge-in), the reply is cancelled and the player stopped. The same logic
serves the desktop (`python -m omni_local voice`, audio_devices.py), the page's voice mode
(ui/voice_mode.py) and tests; push-to-talk skips the detector and answers a whole recording.
"""

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_local.api import AudioChunk, Finished, Reply, TextDelta
from omni_local.errors import OmniLocalError
from omni_local.media import SAMPLE_RATE

CHUNK = 512  # samples per VAD step at 16 kHz (what Silero's streaming model takes)


def _load_vad() -> Any:
    # Imported here: the VAD is the only use of torch on a remote backend, and only in voice mode.
    import torch

    # Importing silero_vad sets torch's thread count to 1 for the whole process; put it back.
    threads = torch.get_num_threads()
    from silero_vad import load_silero_vad

    model = load_silero_vad()
    torch.set_num_threads(threads)
    return model


@dataclass(frozen=True)
class SpeechStarted:
    pass


@dataclass(frozen=True)
class Utterance:
    samples: np.ndarray  # 16 kHz mono float32, with a little audio from before the start


class SpeechDetector:
    def __init__(self, silence_ms: int = 700, pre_roll_ms: int = 300, threshold: float = 0.5) -> None:
        from silero_vad import VADIterator

        self._vad = VADIterator(_load_vad(), threshold=threshold, sampling_rate=SAMPLE_RATE,
                                min_silence_duration_ms=silence_ms)
        self._before: deque[np.ndarray] = deque(maxlen=max(1, pre_roll_ms * SAMPLE_RATE // 1000 // CHUNK))
        self.reset()

    def feed(self, samples: np.ndarray) -> list[SpeechStarted | Utterance]:
        """What the next stretch of microphone audio (16 kHz mono float32) completes."""
        self._pending = np.concatenate([self._pending, samples.astype(np.float32)])
        events: list[SpeechStarted | Utterance] = []
        while len(self._pending) >= CHUNK:
            chunk, self._pending = self._pending[:CHUNK], self._pending[CHUNK:]
            change = self._vad_step(chunk)
            if self._speech is not None:
                self._speech.append(chunk)
            else:
                self._before.append(chunk)
            if "start" in change and self._speech is None:
                self._speech = list(self._before)
                events.append(SpeechStarted())
            if "end" in change and self._speech is not None:
                events.append(Utterance(np.concatenate(self._speech)))
                self._speech = None
                self._before.clear()
        return events

    def _vad_step(self, chunk: np.ndarray) -> dict:
        """Where speech starts or ends in the next CHUNK samples ({} for neither)."""
        import torch

        with torch.inference_mode():
            return self._vad(torch.from_numpy(chunk)) or {}

    def reset(self) -> None:
        """Forget the stream so far: a new recording starts with no utterance under way."""
        self._vad.reset_states()
        self._pending = np.zeros(0, np.float32)
        self._speech: list[np.ndarray] | None = None  # the utterance so far, while one is going on
        self._before.clear()


class VoiceConversation:
    """One spoken conversation: utterances in, spoken replies out, barge-in between.

    `ask` sends an utterance (16 kHz mono float32) as a spoken question and returns its reply: the
    desktop continues one session, the page rebuilds the shown chat's each time."""

    def __init__(
        self,
        ask: Callable[[np.ndarray], Reply],
        play: Callable[[AudioChunk], None],
        stop_playing: Callable[[], None],
        detector: SpeechDetector | None = None,
        show: Callable[[TextDelta | Finished | OmniLocalError], None] = lambda event: None,
    ) -> None:
        self.ask = ask
        self.play, self.stop_playing, self.show = play, stop_playing, show
        self.detector = detector or SpeechDetector()
        self.turns = 0
        self._reply: Reply | None = None
        self._streamer: threading.Thread | None = None
        self._asking = False  # from an utterance's end until its reply's streamer runs
        # Held to cancel and stop the player, and to hand on a chunk: no chunk of a cancelled reply
        # (one the engine was making, or one already waiting in the reply's events) plays after.
        self._playing = threading.Lock()

    def hear(self, samples: np.ndarray) -> None:
        """Microphone audio (16 kHz mono float32), as it arrives."""
        for event in self.detector.feed(samples):
            if isinstance(event, SpeechStarted):
                self.interrupt()
            else:
                self.answer(event.samples)

    def interrupt(self) -> None:
        """Stop the reply being made or played: the person is speaking."""
        with self._playing:
            if self._reply is not None and not self._reply.done:
                self._reply.cancel()
            self.stop_playing()

    @property
    def reply(self) -> Reply | None:
        """The last utterance's reply."""
        return self._reply

    def wait(self) -> None:
        """Until the current reply has been made (its audio handed to the player)."""
        if self._streamer is not None:
            self._streamer.join()

    @property
    def busy(self) -> bool:
        """An utterance is being asked, its reply made, or the reply's last events handed on."""
        return self._asking or (self._streamer is not None and self._streamer.is_alive())

    def answer(self, samples: np.ndarray) -> None:
        """Ask `samples` as one utterance: what the detector found, or a push-to-talk recording."""
        self._asking = True
        try:
            self.wait()  # the interrupted reply ends within one engine step
            self._reply = self.ask(samples)
            self.turns += 1
            self._streamer = threading.Thread(target=self._stream, args=(self._reply,), daemon=True)
            self._streamer.start()
        except OmniLocalError as error:
            self.show(error)
        finally:
            self._asking = False

    def _stream(self, reply: Reply) -> None:
        try:
            for event in reply:
                if isinstance(event, AudioChunk):
                    with self._playing:
                        if not reply.cancelled:
                            self.play(event)
                elif isinstance(event, TextDelta | Finished):  # not its place in line (`Waiting`): no text of the turn
                    self.show(event)
        except OmniLocalError as error:
            self.show(error)
