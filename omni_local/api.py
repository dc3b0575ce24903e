"""The public Python API.

    from omni_local.api import OmniLocal

    with OmniLocal() as app:                       # settings.toml, else the demo model
        chat = app.session(system_prompt="You are concise.")
        for event in chat.send("What is in this picture?", images=["cat.jpg"]):
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)
        print(chat.history[-1].text)               # the reply, kept for the next turn

A reply is a stream of `TextDelta` events (and `AudioChunk`s, for `send(..., speak=True)`) and
one final `Finished` (text, token counts, timings, speech figures). Bad input raises
`OmniLocalError` with a message meant for the user; the session and the engine keep working.
"""

import uuid
from dataclasses import replace
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from omni_local.engine.engine import Engine
from omni_local.engine.request import AudioChunk, Failed, Finished, Request, TextDelta
from omni_local.engine.sampling import SamplingParams
from omni_local.engine.speech import SpeechParams
from omni_local.errors import MediaError, OmniLocalError, RequestError
from omni_local.media import SAMPLE_RATE, MediaLimits, check_duration, load_audio, load_image, prepare_image
from omni_local.media.audio import check_samples
from omni_local.media.video import Video, load_video
from omni_local.model.loader import LoadedModel, load_model
from omni_local.model.workarounds import video_supported
from omni_local.prompts import Message, Part, check_text
from omni_local.settings import Settings, load_settings

__all__ = ["OmniLocal", "Session", "Reply", "TextDelta", "AudioChunk", "Finished", "OmniLocalError"]

ImageInput = str | Path | bytes | Image.Image
AudioInput = str | Path | bytes | np.ndarray  # an ndarray is 16 kHz mono float32 samples
VideoInput = str | Path | bytes | Video


class Reply:
    """One reply as it streams. Iterate it, or call `result()`; `cancel()` from any thread."""

    def __init__(self, request: Request, on_done: Callable[[Finished], None]) -> None:
        self._request = request
        self._on_done = on_done
        self._final: Finished | None = None
        self._error: str | None = None
        self._audio: list[np.ndarray] = []

    def __iter__(self) -> Iterator[TextDelta | AudioChunk | Finished]:
        while self._final is None and self._error is None:
            event = self._request.events.get()
            if isinstance(event, Failed):
                self._error = event.message
            elif isinstance(event, Finished):
                self._final = event
                self._on_done(event)
                yield event
            else:
                if isinstance(event, AudioChunk):
                    self._audio.append(event.samples)
                yield event
        if self._error is not None:
            raise RequestError(self._error)

    def result(self) -> Finished:
        """The final event, once the reply is done; raises `RequestError` if it failed."""
        for _ in self:
            pass
        return self._final

    def cancel(self) -> None:
        self._request.cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._request.cancelled.is_set()

    @property
    def audio(self) -> np.ndarray:
        """The spoken reply's samples so far (float32 mono at 24 kHz, as each `AudioChunk`); empty if none."""
        return np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)

    @property
    def done(self) -> bool:
        return self._final is not None or self._error is not None


class Session:
    """A conversation: its system prompt and history; each reply is added when it finishes."""

    def __init__(self, app: "OmniLocal", system_prompt: str | None, session_id: str | None = None) -> None:
        self._app = app
        self.id = session_id or uuid.uuid4().hex  # the prefix cache keeps one entry per id
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        self.history: list[Message] = [Message("system", [system_prompt])] if system_prompt else []
        self._pending: Reply | None = None

    def send(
        self,
        text: str = "",
        images: Iterable[ImageInput] = (),
        audio: Iterable[AudioInput] = (),
        videos: Iterable[VideoInput] = (),
        speak: bool = False,
        voice: str | None = None,
        talker_temperature: float = SpeechParams.temperature,
        **sampling: object,
    ) -> Reply:
        """Ask the next question. Media are read and checked now: a bad file raises at once.
        `speak` asks for a spoken reply too, in `voice` (the settings' by default); the Talker
        samples at `talker_temperature` (0 is greedy).

        A reply still streaming in this session is waited for first (cancel it to cut it short).
        """
        check_text(text, "the message")
        limits = self._app.limits
        parts: list[Part] = [_image(item, limits) for item in images]
        parts += [_audio(item, limits) for item in audio]
        parts += [self._app.read_video(item) for item in videos]
        if text:
            parts.append(text)
        if not parts:
            raise RequestError("the message is empty: type a question or attach an image, audio or video file")
        params = self._app.sampling(**sampling)
        speech = SpeechParams(voice or self._app.settings.voice, talker_temperature) if speak else None
        self.wait()
        user = Message("user", parts)
        request = self._app.engine.submit(self.id, [*self.history, user], params, speech)
        self._pending = Reply(request, lambda final: self._record(user, final))
        return self._pending

    def wait(self) -> None:
        """Let a reply still streaming finish (or fail) before the history changes."""
        if self._pending is not None and not self._pending.done:
            try:
                self._pending.result()
            except OmniLocalError:
                pass  # the caller of that reply has seen the error
        self._pending = None

    def _record(self, user: Message, final: Finished) -> None:
        self.history += [user, Message("assistant", [final.text], token_ids=final.token_ids)]


class OmniLocal:
    """The model, its engine and settings: one per process."""

    def __init__(self, settings: Settings | None = None, loaded: LoadedModel | None = None) -> None:
        """`loaded`: a model already in memory (the benchmark's random full-size weights); by
        default the checkpoint the settings name is loaded."""
        self.settings = settings or load_settings()
        self.limits = MediaLimits.from_settings(self.settings)
        self.loaded = loaded or load_model(self.settings)
        self.engine = Engine(self.loaded, self.settings)

    def session(self, system_prompt: str | None = None, session_id: str | None = None) -> Session:
        """A new chat; `session_id` names it for the prefix cache (a fresh one by default)."""
        return Session(self, system_prompt, session_id)

    def sampling(self, **overrides: object) -> SamplingParams:
        """Sampling parameters: the settings' defaults, with a request's own values on top."""
        s = self.settings
        values = dict(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            repetition_penalty=s.repetition_penalty,
        )
        unknown = sorted(set(overrides) - {*values, "seed"})
        if unknown:
            raise RequestError(f"unknown sampling parameter '{unknown[0]}'")
        values.update(overrides)
        return SamplingParams(**values)

    def read_video(self, item: VideoInput) -> Video:
        """A video as the model takes it: frames at the checkpoint's rate (else `video_fps`), and its
        sound track if `use_audio_in_video` (a silent clip then gets silence, so every video of a
        prompt is laid out alike)."""
        if not video_supported(self.loaded.processor):
            raise MediaError("video input needs torchvision, which is not installed here")
        video = item
        if not isinstance(video, Video):
            processor = self.loaded.processor.video_processor
            fps = getattr(processor, "fps", None) or self.settings.video_fps
            video = load_video(video, self.limits, fps, processor.min_frames, processor.max_frames)
        elif video.audio is not None:
            check_samples("video", video.audio, "the sound track")  # as a file's is
        if not self.settings.use_audio_in_video:
            return replace(video, audio=None)
        if video.audio is None:
            return replace(video, audio=np.zeros(round(video.seconds * SAMPLE_RATE), np.float32))
        return video

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "OmniLocal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _image(item: ImageInput, limits: MediaLimits) -> Image.Image:
    if isinstance(item, Image.Image):
        return prepare_image(item, limits)
    return load_image(item, limits)


def _audio(item: AudioInput, limits: MediaLimits) -> np.ndarray:
    if isinstance(item, np.ndarray):
        check_duration("audio", item.size / SAMPLE_RATE, limits)
        samples = item.astype(np.float32).reshape(-1)
        check_samples("audio", samples)  # as a file's are: a NaN would make every output of the model NaN
        return samples
    return load_audio(item, limits)
