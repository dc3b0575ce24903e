"""A conversation as the body of a streamed chat-completions request, in the dialect the server speaks,
with the tools it offers (OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`).

Each message's parts keep their order, since the server's prompt follows it. Media go inline, as
data URLs or base64, and losslessly: a server that keys its caches by content (ours digests an
image's pixels, a clip's samples) then finds the same image or clip again on every later turn.
"""

import base64
import io
import mimetypes
import weakref
from typing import Any

import numpy as np
from PIL import Image

from omni_local.backends.remote.audio import wav_base64
from omni_local.errors import MediaError
from omni_local.media.video import Video, VideoFile
from omni_local.protocol.messages import Message, Part
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.protocol.tools import ToolUse
from omni_local.settings import BackendDialect

# OpenAI streams spoken replies only as PCM16, at 24 kHz; vLLM-Omni sends WAV unless told otherwise.
_STREAMED_AUDIO_FORMAT = "pcm16"
# PNG's fastest level: still lossless, and quick for a large picture's first send.
_PNG_COMPRESSION = 1
_VIDEO_FALLBACK_TYPE = "video/mp4"
# Each medium's content part, by the id of the part it encodes, while that part lives: a chat's
# history holds the same image and clip objects turn after turn (the session's history, the page's
# decoded uploads), and each is encoded once, not at every turn.
_encoded: dict[int, dict[str, Any]] = {}
VIDEO_AS_FILE = ("a remote backend sends a video as its file, not decoded frames: give the file (its path or "
                 "bytes), or read it with OmniLocal.read_video")


def chat_body(model: str, messages: list[Message], params: SamplingParams, speech: SpeechParams | None,
              dialect: BackendDialect, tools: ToolUse | None = None) -> dict[str, Any]:
    """The request's JSON body. `max_tokens` goes with `max_completion_tokens`: vLLM-Omni's Thinker
    reads only the older name. `top_k` is sent only when it limits, since servers spell "off"
    differently (0 or -1); `max_reasoning_tokens` (our server's) too."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [_message(message) for message in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        # Named even for text: vLLM-Omni's default is text and audio, and its stream requires the list.
        "modalities": ["text", "audio"] if speech else ["text"],
        "max_completion_tokens": params.max_new_tokens,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.top_k:
        body["top_k"] = params.top_k
    if params.max_reasoning_tokens:
        body["max_reasoning_tokens"] = params.max_reasoning_tokens
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": params.logprobs}
    if speech is not None:
        body |= _speech_fields(speech, dialect)
    if tools is not None:
        body |= _tool_fields(tools)
    return body


def _tool_fields(use: ToolUse) -> dict[str, Any]:
    choice = use.choice if isinstance(use.choice, str) else {"type": "function", "function": {"name": use.choice.name}}
    return {"tools": [tool.for_template() for tool in use.tools], "tool_choice": choice,
            "parallel_tool_calls": use.parallel}


def _speech_fields(speech: SpeechParams, dialect: BackendDialect) -> dict[str, Any]:
    """How the request names the voice and the audio's format: "auto" is for a server we know nothing
    of, and names the voice both ways (each dialect's server ignores the other's field)."""
    # The Talker's temperature is omni_local's own field: a server of OpenAI's dialect that does not
    # know it ignores it.
    openai = {"audio": {"voice": speech.voice, "format": _STREAMED_AUDIO_FORMAT},
              "talker_temperature": speech.temperature}
    vllm_omni = {"speaker": speech.voice}
    return {"openai": openai, "vllm-omni": vllm_omni, "auto": openai | vllm_omni}[dialect]


def _message(message: Message) -> dict[str, Any]:
    if message.role == "user":
        return {"role": "user", "content": [_content_part(part) for part in message.parts]}
    # A system prompt, an earlier reply (its text, reasoning and calls), or a tool's result: text.
    sent: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.reasoning:
        sent["reasoning_content"] = message.reasoning
    if message.tool_calls:
        sent["content"] = message.text or None
        sent["tool_calls"] = [call.openai() for call in message.tool_calls]
    if message.tool_call_id is not None:
        sent["tool_call_id"] = message.tool_call_id
    return sent


def _content_part(part: Part) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    key = id(part)
    if key not in _encoded:
        _encoded[key] = _media_part(part)
        weakref.finalize(part, _encoded.pop, key, None)  # forgotten with the part, before its id is reused
    return _encoded[key]


def _media_part(part: Part) -> dict[str, Any]:
    if isinstance(part, Image.Image):
        return {"type": "image_url", "image_url": {"url": _data_url("image/png", _png(part))}}
    if isinstance(part, np.ndarray):
        return {"type": "input_audio", "input_audio": {"data": wav_base64(part), "format": "wav"}}
    if isinstance(part, VideoFile):
        guessed = mimetypes.guess_type(part.name)[0] or ""
        kind = guessed if guessed.startswith("video/") else _VIDEO_FALLBACK_TYPE  # a name without a video suffix
        return {"type": "video_url", "video_url": {"url": _data_url(kind, part.data)}}
    if isinstance(part, Video):
        raise MediaError(VIDEO_AS_FILE)
    raise TypeError(f"not a message part: {type(part).__name__}")


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=_PNG_COMPRESSION)
    return buffer.getvalue()


def _data_url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"
