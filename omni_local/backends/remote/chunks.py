"""A reply's streamed chunks, read in the dialect of the server that sends them.

OpenAI's dialect (our server, mstar, SGLang-Omni): text in `delta.content`, a Thinking checkpoint's
reasoning in `delta.reasoning_content` (vLLM's newer servers: `delta.reasoning`); a spoken reply's
text in `delta.audio.transcript` and its sound in `delta.audio.data` (base64 PCM16, 24 kHz).
vLLM-Omni's: each chunk says what it holds in a top-level `"modality"`; those marked "audio" carry
the sound as a base64 WAV file in `delta.content`, and the others carry text there. A stream in
"auto" is read as OpenAI's until a chunk has a `modality`. Both end with a chunk without choices
that holds `usage`; our server also puts its figures in an `"omni_local"` object on the last chunk.
A choice's `logprobs.content` (asked for with `logprobs`) goes with the chunk's text, OpenAI's way;
a server that answers such a request with text and no `logprobs` does not implement them, and the
reply fails saying so rather than come without them. Tool calls come in pieces in
`delta.tool_calls` (by index: id, type and name, then the arguments' text): each is a `ToolCall`
once the stream has ended.
"""

from typing import Any

import numpy as np

from omni_local.backends.remote.audio import SpeechDecoder
from omni_local.errors import RequestError
from omni_local.protocol.events import AudioChunk, ReasoningDelta, TextDelta, TokenChoice, TokenLogprob
from omni_local.protocol.functions import ToolCall
from omni_local.settings import BackendDialect



class ChunkReader:
    """What each chunk adds to the reply, and what the stream said about the reply as a whole."""

    def __init__(self, dialect: BackendDialect, spoken: bool, logprobs: bool = False) -> None:
        self.dialect: BackendDialect = dialect  # "auto" until a chunk tells
        self.spoken = spoken
        self.logprobs = logprobs  # asked for
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.report: dict[str, Any] | None = None  # our server's figures (figures.py)
        self._speech = SpeechDecoder()
        self._calls: dict[int, dict[str, str]] = {}  # tool calls by index, as their pieces came

    def read(self, chunk: dict[str, Any]) -> list[TextDelta | ReasoningDelta | AudioChunk]:
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
        events: list[TextDelta | ReasoningDelta | AudioChunk] = []
        for choice in choices[:1]:  # one reply asked for (n = 1)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                events.append(ReasoningDelta(reasoning))
            if self.dialect == "vllm-omni":
                said = self._vllm_omni(delta, modality)
            else:
                said = self._openai(delta)
            self._add_calls(delta.get("tool_calls"))
            if self.logprobs and not isinstance(choice.get("logprobs"), dict) and _has_text(said):
                raise RequestError("the server sent text without logprobs: it does not implement them "
                                   "(ask without logprobs)")
            events += _with_logprobs(said, _logprobs(choice.get("logprobs")))
        return events

    def rest(self) -> list[AudioChunk | ToolCall]:
        """The last of the sound, and the reply's tool calls, once the stream has ended."""
        calls = [self._call(self._calls[index]) for index in sorted(self._calls)]
        return [*_audio(self._speech.flush()), *calls]

    def _add_calls(self, pieces: Any) -> None:
        """A delta's pieces of tool calls: each call's id, type and name, then pieces of its arguments."""
        for piece in pieces if isinstance(pieces, list) else []:
            call = self._calls.setdefault(piece.get("index", 0), {"id": "", "name": "", "arguments": ""})
            function = piece.get("function") or {}
            call["id"] = piece.get("id") or call["id"]
            call["name"] = function.get("name") or call["name"]
            call["arguments"] += function.get("arguments") or ""

    def _call(self, call: dict[str, str]) -> ToolCall:
        try:
            return ToolCall(call["id"], call["name"], call["arguments"] or "{}")
        except RequestError as error:
            raise RequestError(f"the server sent a tool call that is not OpenAI's: {error}") from None

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


def _has_text(events: list[TextDelta | AudioChunk]) -> bool:
    return any(isinstance(event, TextDelta) and event.text for event in events)


def _with_logprobs(events: list[TextDelta | AudioChunk], logprobs: tuple[TokenLogprob, ...]
                   ) -> list[TextDelta | AudioChunk]:
    """`events` with `logprobs` on their text (a text of its own if they have none: the tokens made none)."""
    if not logprobs:
        return events
    at = next((index for index, event in enumerate(events) if isinstance(event, TextDelta)), None)
    if at is None:
        return [TextDelta("", logprobs), *events]
    return [*events[:at], TextDelta(events[at].text, logprobs), *events[at + 1:]]


def _logprobs(found: Any) -> tuple[TokenLogprob, ...]:
    """A choice's `logprobs` as the API's entries; none where it has none."""
    content = found.get("content") if isinstance(found, dict) else None
    return tuple(_entry(entry) for entry in content or [])


def _entry(entry: dict[str, Any]) -> TokenLogprob:
    top = tuple(TokenChoice(*_choice(other)) for other in entry.get("top_logprobs") or [])
    return TokenLogprob(*_choice(entry), top)


def _choice(entry: dict[str, Any]) -> tuple[str, float, bytes | None]:
    utf8 = entry.get("bytes")
    return entry["token"], entry["logprob"], bytes(utf8) if utf8 is not None else None


def _audio(samples: np.ndarray) -> list[AudioChunk]:
    return [AudioChunk(samples)] if samples.size else []
