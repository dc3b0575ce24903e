"""A conversation (`Session`) and one reply as it streams (`Reply`), on any backend.

A session is given the backend, settings and media limits it uses, not its app (api/app.py, which
makes sessions), so the facade's two modules import one way.
"""

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from omni_local.access import LOCAL_USER
from omni_local.api.arguments import AUDIO, IMAGES, TOOLS, VIDEOS, listed
from omni_local.errors import OmniLocalError, RequestError
from omni_local.media import MediaLimits, load_audio, load_image, prepare_image
from omni_local.media.audio import samples_from_array
from omni_local.media.video import Video
from omni_local.protocol.backend import Backend, ReplyStream
from omni_local.protocol.events import AudioChunk, Event, Finished, Waiting
from omni_local.protocol.functions import Tool
from omni_local.protocol.messages import Message, Part
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.protocol.text import check_text
from omni_local.protocol.tools import ToolChoice, ToolUse
from omni_local.settings import Settings

ImageInput = str | Path | bytes | Image.Image
# An ndarray is 16 kHz samples: (samples,), or (samples, channels) / (channels, samples) with at most
# 8 channels, averaged into one (media.audio.samples_from_array).
AudioInput = str | Path | bytes | np.ndarray
VideoInput = str | Path | bytes | Video


class Reply:
    """One reply as it streams. Iterate it, or call `result()`; `cancel()` from any thread. One the
    engine cannot start at once streams `Waiting` events first, its place in line (`waiting`)."""

    def __init__(self, stream: ReplyStream, on_done: Callable[[Finished], None]) -> None:
        self._stream = stream
        self._events = stream.events()
        self._on_done = on_done
        self._final: Finished | None = None
        self._error: OmniLocalError | None = None
        self._cancelled = False
        self._audio: list[np.ndarray] = []
        self._ahead = 0

    def __iter__(self) -> Iterator[Event]:
        if self._error is not None:
            raise self._error
        try:
            for event in self._events:
                if isinstance(event, Finished):
                    self._final = event
                    self._on_done(event)
                elif isinstance(event, AudioChunk):
                    self._audio.append(event.samples)
                self._ahead = event.ahead if isinstance(event, Waiting) else 0
                yield event
        except OmniLocalError as error:
            self._error = error
            raise

    def result(self) -> Finished:
        """The final event, once the reply is done; raises `RequestError` if it failed."""
        for _ in self:
            pass
        return self._final

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def audio(self) -> np.ndarray:
        """The spoken reply's samples so far (float32 mono at 24 kHz, as each `AudioChunk`); empty if none."""
        return np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)

    @property
    def waiting(self) -> int:
        """The replies ahead of this one as its last event read said, while that was a `Waiting`
        (the first in line waits for 1); 0 once any other came, or if none did."""
        return self._ahead

    @property
    def done(self) -> bool:
        return self._final is not None or self._error is not None


class Session:
    """A conversation: its system prompt and history; each reply is added when it finishes."""

    def __init__(self, backend: Backend, settings: Settings, limits: MediaLimits, system_prompt: str | None,
                 session_id: str | None = None, principal: str = LOCAL_USER) -> None:
        self._backend = backend
        self._settings = settings
        self._limits = limits
        self.id = session_id or uuid.uuid4().hex  # the prefix cache keeps one entry per id ...
        self.principal = principal  # ... and shares what it holds only among this principal's sessions
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
        tools: Iterable[Tool] = (),
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        tool_results: Mapping[str, str] | None = None,
        **sampling: object,
    ) -> Reply:
        """Ask the next question. Media are read and checked now: a bad file, or an item of the wrong
        type, raises at once (`OmniLocalError`, naming it: "images[0]: expected ..."); each of
        `images`, `audio` and `videos` is a list (see `ImageInput`, `AudioInput`, `VideoInput`).
        `speak` asks for a spoken reply too, in `voice` (the settings' by default); the Talker
        samples at `talker_temperature` (0 is greedy).

        `tools` offers functions to call, as OpenAI's chat API does (`tool_choice`: "auto", "none",
        "required" or `FunctionChoice(name)`; `parallel_tool_calls`); the reply's calls come as
        `ToolCall` events and on its `Finished.tool_calls`. Their results go back in the next send's
        `tool_results`, by call id (with or without text).

        A reply still streaming in this session is waited for first (cancel it to cut it short).
        """
        parts = self._parts(text, images, audio, videos)
        use = ToolUse(tuple(listed("tools", tools, TOOLS)), tool_choice, _flag("parallel_tool_calls",
                                                                                   parallel_tool_calls))
        params = sampling_params(self._settings, **sampling)
        speech = self._speech(speak, voice, talker_temperature)
        self.wait()
        turn = [*self._results(tool_results or {}), *([Message("user", parts)] if parts else [])]
        if not turn:
            raise RequestError("the message is empty: type a question or attach an image, audio or video file")
        stream = self._backend.send(self.id, [*self.history, *turn], params, speech, self.principal,
                                    use if use.tools else None)
        self._pending = Reply(stream, lambda final: self._record(turn, final))
        return self._pending

    def _results(self, results: Mapping[str, str]) -> list[Message]:
        """Tool messages for `results`, each answering a call of the last reply."""
        calls = {call.id for call in self.history[-1].tool_calls} if self.history else set()
        for call, result in results.items():
            if call not in calls:
                raise RequestError(f"tool_results: the last reply made no call {call!r}")
            check_text(result, f"the result of call {call}")
        return [Message("tool", [result], tool_call_id=call) for call, result in results.items()]

    def _parts(self, text: str, images: object, audio: object, videos: object) -> list[Part]:
        """The question's media, read and checked (each argument's types first, before any is
        read), then its text."""
        check_text(text, "the message")
        images, audio = listed("images", images, IMAGES), listed("audio", audio, AUDIO)
        videos = listed("videos", videos, VIDEOS)
        limits = self._limits
        parts: list[Part] = [_image(item, limits, f"images[{n}]") for n, item in enumerate(images)]
        parts += [_audio(item, limits, f"audio[{n}]") for n, item in enumerate(audio)]
        parts += [self._backend.read_video(_named_video(item, f"videos[{n}]")) for n, item in enumerate(videos)]
        return parts + [text] if text else parts

    def _speech(self, speak: object, voice: object, temperature: float) -> SpeechParams | None:
        """What `send`'s speech arguments ask for; `speak` is a flag, not any value Python calls true
        (speak="no" would speak)."""
        if not isinstance(speak, bool):
            raise RequestError(f"speak: expected True or False, got {type(speak).__name__}")
        if voice is not None:
            check_text(voice, "the voice")
        return SpeechParams(voice or self._settings.voice, temperature) if speak else None

    def wait(self) -> None:
        """Let a reply still streaming finish (or fail) before the history changes."""
        if self._pending is not None and not self._pending.done:
            try:
                self._pending.result()
            except OmniLocalError:
                pass  # the caller of that reply has seen the error
        self._pending = None

    def _record(self, turn: list[Message], final: Finished) -> None:
        self.history += [*turn, Message("assistant", [final.text], token_ids=final.token_ids,
                                        reasoning=final.reasoning, tool_calls=final.tool_calls)]


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected True or False, got {type(value).__name__}")
    return value


def sampling_params(settings: Settings, **overrides: object) -> SamplingParams:
    """Sampling parameters: the settings' defaults, with a request's own values on top."""
    values = dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        repetition_penalty=settings.repetition_penalty,
        max_reasoning_tokens=settings.max_reasoning_tokens,
    )
    unknown = sorted(set(overrides) - {*values, "seed", "logprobs"})
    if unknown:
        raise RequestError(f"unknown sampling parameter '{unknown[0]}'")
    values.update(overrides)
    return SamplingParams(**values)


def _image(item: ImageInput, limits: MediaLimits, name: str) -> Image.Image:
    """`name` calls an image in memory in errors; a file is called by its file name."""
    if isinstance(item, Image.Image):
        return prepare_image(item, limits, name)
    return load_image(item, limits)


def _audio(item: AudioInput, limits: MediaLimits, name: str) -> np.ndarray:
    if isinstance(item, np.ndarray):
        return samples_from_array(name, item, limits)
    return load_audio(item, limits)


def _named_video(item: VideoInput, name: str) -> VideoInput:
    """A video in memory named as its argument, for the errors its checks may raise."""
    return replace(item, name=name) if isinstance(item, Video) else item
