"""A reply's streamed chunks, read in the dialect of the server that sends them.

OpenAI's dialect (our server, mstar, SGLang-Omni): text in `delta.content`; a spoken reply's text
in `delta.audio.transcript` and its sound in `delta.audio.data` (base64 PCM16, 24 kHz).
vLLM-Omni's: each chunk says what it holds in a top-level `"modality"`; those marked "audio" carry
the sound as a base64 WAV file in `delta.content`, and the others carry text there. A stream in
"auto" is read as OpenAI's until a chunk has a `modality`. Both end with a chunk without choices
that holds `usage`; our server also puts its figures in an `"omni_local"` object on the last chunk.
"""

from typing import Any

import numpy as np

from omni_local.api.events import AudioChunk, TextDelta
from omni_local.backends.remote.audio import SpeechDecoder
from omni_local.errors import RequestError
from omni_local.settings import BackendDialect



class ChunkReader:
    """What each chunk adds to the reply, and what the stream said about the reply as a whole."""

    def __init__(self, dialect: BackendDialect, spoken: bool) -> None:
        self.dialect: BackendDialect = dialect  # "auto" until a chunk tells
        self.spoken = spoken
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.report: dict[str, Any] | None = None  # our server's figures (figures.py)
        self._speech = SpeechDecoder()

    def read(self, chunk: dict[str, Any]) -> list[TextDelta | AudioChunk]:
        """The text and audio in `chunk` (a chunk as JSON, with the fields OpenAI's types lack)."""
        if chunk.get("object") == "error":  # vLLM's older error event, without an "error" key
            raise RequestError(f"the server failed: {chunk.get('message') or 'no reason given'}")
        if isinstance(chunk.get("omni_local"), dict):
            self.report = chunk["omni_local"]
        choices = chunk.get("choices") or []
        if not choices and chunk.get("usage"):
            # Only the closing chunk's usage counts: vLLM-Omni's audio chunks carry one too, with no
            # reply tokens in it.
            self.usage = chunk["usage"]
        modality = chunk.get("modality")
        if self.dialect == "auto" and modality is not None:
            self.dialect = "vllm-omni"
        events: list[TextDelta | AudioChunk] = []
        for choice in choices[:1]:  # one reply asked for (n = 1)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if self.dialect == "vllm-omni":
                events += self._vllm_omni(delta, modality)
            else:
                events += self._openai(delta)
        return events

    def rest(self) -> list[AudioChunk]:
        """The last of the sound, once the stream has ended."""
        return _audio(self._speech.flush())

    def _openai(self, delta: dict[str, Any]) -> list[TextDelta | AudioChunk]:
        audio = delta.get("audio") or {}
        text = delta.get("content") or (audio.get("transcript") if self.spoken else None)
        events: list[TextDelta | AudioChunk] = [TextDelta(text)] if text else []
        if audio.get("data"):
            events += _audio(self._speech.decode(audio["data"]))
        return events

    def _vllm_omni(self, delta: dict[str, Any], modality: str | None) -> list[TextDelta | AudioChunk]:
        content = delta.get("content")
        if not content:
            return []
        if modality == "audio":
            return _audio(self._speech.decode(content))
        return [TextDelta(content)] if modality in (None, "text") else []


def _audio(samples: np.ndarray) -> list[AudioChunk]:
    return [AudioChunk(samples)] if samples.size else []
