"""A reply on the wire, in OpenAI's shapes: the streamed `chat.completion.chunk`s, and the
non-streamed `chat.completion`.

Streamed (server-sent events, each `data:` one JSON chunk; the first delta carries the role):
- text only: `choices[0].delta.content`, a piece of the text; a Thinking checkpoint's reasoning,
  before it, as `delta.reasoning_content` (as vLLM and DeepSeek send it);
- with audio (`modalities: ["text", "audio"]`): `delta.audio = {"id", "transcript"}` for a piece of
  the text, `delta.audio = {"id", "data"}` for a piece of the speech, base64 PCM16 (audio.py), the
  reply's one audio id in each;
- a tool call (a request with `tools`), once its text is whole: a chunk with `delta.tool_calls =
  [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]`, then one with its
  arguments, `[{"index", "function": {"arguments"}}]`, as OpenAI streams them;
- then a chunk with an empty delta, `finish_reason` ("stop": the reply's end or a stop string;
  "length": max_tokens or the context's end; "tool_calls": the reply called tools) and the
  `omni_local` figures (figures.py);
- with `stream_options.include_usage`, then a chunk of no choices with `usage` (the chunks before
  carry `"usage": null`, as OpenAI's do);
- then `data: [DONE]`. A failure after the stream began is one event `{"error": {...}}`, and the
  stream ends; a reply the server's shutdown cuts (shutdown.py) sends a chunk with `finish_reason`
  "abort" before it.

With `logprobs: true`, each chunk of the answer's text carries `choices[0].logprobs = {"content":
[...], "refusal": null}`: an entry per token whose text the chunk completes, `{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}` (the `top_logprobs` likeliest, best
first; protocol/events.py says which distribution), as OpenAI's; a whole reply's choice carries them all.

Not streamed: `choices[0].message` holds the text as `content` (and any reasoning as
`reasoning_content`; any tool calls as `tool_calls`, `content` then null if the reply said nothing
else); with audio, `content` is null and
`message.audio = {"id", "data", "transcript", "expires_at"}`, `data` the whole speech as a base64
WAV file or PCM16, per `audio.format` (a spoken reply that calls tools: the speech of its text before
the first call; one that is calls alone has no `audio`). The server keeps no audio to refer to later: `expires_at` is
the reply's own time. `usage` and `omni_local` at the top level.
"""

import time
import uuid

import numpy as np

from omni_local.media.pcm16 import base64_pcm16
from omni_local.protocol.events import AudioChunk, Finished, ReasoningDelta, TextDelta, TokenChoice, TokenLogprob
from omni_local.protocol.functions import ToolCall
from omni_local.server.audio import base64_wav
from omni_local.server.figures import finish_reason, omni_local_figures, usage


class ReplyShapes:
    """The chunks, or the completion, of one reply to `model`; `speaks`: with audio; `logprobs`: with
    its tokens' log-probabilities."""

    def __init__(self, model: str, speaks: bool, include_usage: bool = False, logprobs: bool = False) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.audio_id = f"audio_{uuid.uuid4().hex}" if speaks else None
        self.include_usage = include_usage
        self.logprobs = logprobs
        self._role_sent = False
        self._calls = 0  # tool calls streamed

    def chunk(self, event: TextDelta | ReasoningDelta | AudioChunk) -> dict:
        if isinstance(event, ReasoningDelta):
            delta: dict = {"reasoning_content": event.text}
        elif self.audio_id is None:
            delta: dict = {"content": event.text}
        elif isinstance(event, TextDelta):
            delta = {"audio": {"id": self.audio_id, "transcript": event.text}}
        else:
            delta = {"audio": {"id": self.audio_id, "data": base64_pcm16(event.samples)}}
        if not self._role_sent:
            delta, self._role_sent = {"role": "assistant", **delta}, True
        logprobs = self._logprobs(event.logprobs) if isinstance(event, TextDelta) else None
        return self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}])

    def tool_call_chunks(self, call: ToolCall) -> list[dict]:
        """A call as OpenAI streams one: its index, id, type and name, then its arguments."""
        index, self._calls = self._calls, self._calls + 1
        opening = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        delta: dict = {"content": None, "tool_calls": [opening]}
        if not self._role_sent:
            delta, self._role_sent = {"role": "assistant", **delta}, True
        arguments = {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}
        return [self._chunk([{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}])
                for d in (delta, arguments)]

    def last_chunks(self, final: Finished) -> list[dict]:
        ending = self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(final)}])
        ending["omni_local"] = omni_local_figures(final)
        if not self.include_usage:
            return [ending]
        return [ending, {**self._chunk([]), "usage": usage(final)}]

    def cut_chunk(self) -> dict:
        """The last chunk of a reply the server cut short, as vLLM ends an aborted one."""
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort"}])

    def completion(self, final: Finished, speech: np.ndarray | None, audio_format: str,
                   logprobs: list[TokenLogprob]) -> dict:
        message: dict = {"role": "assistant", "content": final.text, "refusal": None}
        if final.reasoning:
            message["reasoning_content"] = final.reasoning
        if final.tool_calls:
            message["content"] = final.text or None
            message["tool_calls"] = [call.openai() for call in final.tool_calls]
        # A reply of calls alone has no speech: no `audio`, as OpenAI's.
        if self.audio_id is not None and (len(speech) or not final.tool_calls):
            data = base64_wav(speech) if audio_format == "wav" else base64_pcm16(speech)
            message["content"] = None
            message["audio"] = {"id": self.audio_id, "data": data, "transcript": final.text,
                                "expires_at": self.created}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason(final)}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage(final),
                "omni_local": omni_local_figures(final)}

    def _logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [{**_choice(entry), "top_logprobs": [_choice(c) for c in entry.top]} for entry in entries],
                "refusal": None}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self._head("chat.completion.chunk"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}


def _choice(choice: TokenChoice) -> dict:
    utf8 = list(choice.utf8) if choice.utf8 is not None else None
    return {"token": choice.token, "logprob": choice.logprob, "bytes": utf8}
