"""Servers of OpenAI's chat API on `httpx.MockTransport`, for the remote backend's tests: a model
list, and recorded streams replayed through the same `openai` client the backend uses.

The streams are written from each dialect's documented shapes (see omni_local/backends/remote):
OpenAI's chunks with `delta.content`, or `delta.audio` {id, data (base64 PCM16 at 24 kHz),
transcript}; vLLM-Omni's chunks marked `"modality"`, its audio a base64 WAV file in `delta.content`;
both closed by a chunk without choices that holds `usage`, then `data: [DONE]`.
"""

import base64
import io
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import soundfile

import omni_local.backends.remote as remote
from omni_local.media.pcm16 import to_pcm16
from omni_local.api import OmniLocal
from omni_local.backends.remote import RemoteBackend
from omni_local.settings import Settings

URL = "http://omni.test/v1"
QWEN = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
# Our server's model entry: its context, and what it serves in its "omni_local" object.
OUR_MODEL = {"id": "demo", "object": "model", "created": 0, "owned_by": "omni_local", "max_model_len": 1024,
             "omni_local": {"speech": True, "voices": ["Ethan"], "max_prompt_tokens": 960, "video": True,
                            "runs_on": "float32 on cpu", "model": "demo model: random weights, replies are noise"}}
# vLLM's model entry, as vLLM-Omni lists Qwen3-Omni.
VLLM_MODEL = {"id": QWEN, "object": "model", "created": 1, "owned_by": "vllm", "root": QWEN, "parent": None,
              "max_model_len": 65536, "permission": []}
USAGE = {"prompt_tokens": 27, "completion_tokens": 3, "total_tokens": 30}


def remote_settings(**changes: Any) -> Settings:
    return Settings(backend="openai", backend_url=URL).replace(**changes)


Chunks = list[dict[str, Any]]
Reply = Callable[[dict[str, Any]], httpx.Response]  # a chat request's body -> the server's answer


@dataclass
class RecordedServer:
    """Lists `models`; answers each chat request with the next of `replies` (a recorded stream, as
    chunks, or an answer of its own), and keeps the request bodies it was sent."""

    models: list[dict[str, Any]] = field(default_factory=lambda: [OUR_MODEL])
    replies: list[Chunks | Reply] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[httpx.Headers] = field(default_factory=list)  # of each chat request

    def backend(self, **settings: Any) -> RemoteBackend:
        return RemoteBackend(remote_settings(**settings), self.http_client())

    def http_client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self._answer))

    def _answer(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": self.models})
        assert request.method == "POST" and request.url.path == "/v1/chat/completions", request.url
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        reply = self.replies.pop(0)
        return reply(body) if callable(reply) else event_stream(reply)


def remote_app(monkeypatch: Any, server: RecordedServer, **settings: Any) -> OmniLocal:
    """`OmniLocal` on `backend = "openai"`, its backend's client on `server`'s transport."""
    monkeypatch.setattr(remote, "RemoteBackend", lambda made: RemoteBackend(made, server.http_client()))
    return OmniLocal(remote_settings(**settings))


def event_stream(chunks: Chunks | Iterator[dict[str, Any]]) -> httpx.Response:
    """Server-sent events of `chunks`, then `[DONE]`, streamed as the client reads them."""
    def body() -> Iterator[bytes]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def error_answer(status: int, message: str) -> Reply:
    return lambda body: httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error",
                                                               "code": status}})


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "demo",
            "choices": choices, **top}


def text_stream(texts: list[str], finish: str = "stop", usage: dict | None = None, **last: Any) -> Chunks:
    """OpenAI's text reply: a role chunk, one chunk a piece, `finish` on the last (with `last`'s
    fields beside it), then the usage chunk."""
    pieces = [chunk({"role": "assistant", "content": ""})]
    pieces += [chunk({"content": text}) for text in texts]
    pieces.append(chunk({}, finish, **last))
    return pieces + [chunk(usage=usage or USAGE)]


def openai_spoken_stream(texts: list[str], pcm: list[np.ndarray], usage: dict | None = None, **last: Any) -> Chunks:
    """OpenAI's spoken reply: each text piece as `delta.audio.transcript`, each piece of sound
    (float32 at 24 kHz) as `delta.audio.data`, PCM16."""
    pieces = [chunk({"role": "assistant", "audio": {"id": "audio_1", "transcript": text}}) for text in texts]
    pieces += [chunk({"audio": {"id": "audio_1", "data": pcm16_base64(samples)}}) for samples in pcm]
    pieces.append(chunk({"audio": {"id": "audio_1", "expires_at": 1}}, "stop", **last))
    return pieces + [chunk(usage=usage or USAGE)]


def vllm_omni_stream(texts: list[str], wavs: list[tuple[np.ndarray, int]], usage: dict | None = None) -> Chunks:
    """vLLM-Omni's spoken reply: "text" chunks, then "audio" chunks each holding a WAV file (of
    `(samples, rate)`), each with a usage of no reply tokens; only the last audio chunk keeps its
    finish reason; then the usage chunk, unmarked."""
    pieces = [chunk({"role": "assistant", "content": ""}, modality="text")]
    pieces += [chunk({"content": text}, modality="text") for text in texts]
    pieces.append(chunk({"content": ""}, modality="text"))  # the text's end: its finish reason held back
    no_reply = {"prompt_tokens": 27, "completion_tokens": 0, "total_tokens": 27}
    for n, (samples, rate) in enumerate(wavs):
        finish = "stop" if n == len(wavs) - 1 else None
        pieces.append(chunk({"role": "assistant", "content": wav_base64(samples, rate)}, finish, modality="audio",
                            usage=no_reply))
    return pieces + [chunk(usage=usage or USAGE)]


def pcm16_base64(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples).tobytes()).decode()


def wav_base64(samples: np.ndarray, rate: int) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, subtype="PCM_16", format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


def tone(seconds: float, rate: int = 24_000) -> np.ndarray:
    """A quiet 220 Hz tone, float32, exactly representable in PCM16."""
    t = np.arange(round(seconds * rate)) / rate
    return (np.round(np.sin(2 * np.pi * 220 * t) * 0.3 * 32767) / 32767).astype(np.float32)


class HeldStream:
    """A recorded stream that holds at `hold_after` chunks until released: a server still thinking."""

    def __init__(self, chunks: Chunks, hold_after: int) -> None:
        self.chunks, self.hold_after = chunks, hold_after
        self.released = threading.Event()
        self.sent = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for n, piece in enumerate(self.chunks):
            if n == self.hold_after:
                self.released.wait(10)
            self.sent += 1
            yield piece
