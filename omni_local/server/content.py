"""OpenAI's message content as omni_local's messages: text, and media decoded by omni_local's own
loaders within the settings' limits, in the order the parts came (the prompt follows it).

Media come inside the request: images and videos as data URLs (`data:image/png;base64,...`), audio as
base64 (WAV or MP3). The server never fetches a URL: an http(s) one is refused, saying to send a data
URL. A file on this machine (`file:///path`, or a bare path) is read only where `api_local_files`
allows it, for clients on the same machine.

A bad medium is a `MediaError` naming the part by its place in the request ("messages[1].content[0]").
Decoding is blocking work: call from a worker thread.
"""

import base64
import binascii
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from omni_local.errors import RequestError
from omni_local.media import MediaLimits, load_audio, load_image
from omni_local.protocol.messages import Message, Part, Role
from omni_local.protocol.text import check_text
from omni_local.server.errors import ApiError
from omni_local.server.schemas import AudioPart, ChatMessage, ImagePart, TextPart, VideoPart
from omni_local.server.tools import check_results, tool_calls

ReadVideo = Callable[[bytes | Path], Part]


class ContentReader:
    """Reads requests' messages within `limits`; `read_video` is the app's, which decodes a video as
    its backend takes it."""

    def __init__(self, limits: MediaLimits, read_video: ReadVideo, local_files: bool) -> None:
        self.limits = limits
        self.read_video = read_video
        self.local_files = local_files

    def conversation(self, messages: list[ChatMessage]) -> list[Message]:
        """The request's messages, which must end in the user's (or a tool's result)."""
        if messages[-1].role not in ("user", "tool"):
            raise RequestError(f"messages[{len(messages) - 1}]: the last message must be the user's or a tool's, "
                               f"not the {messages[-1].role}'s")
        conversation = [self._message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        check_results(conversation)
        return conversation

    def _message(self, message: ChatMessage, where: str) -> Message:
        role: Role = "system" if message.role == "developer" else message.role
        content = message.content
        if content is None and role == "assistant" and not message.tool_calls:
            raise RequestError(f"{where}: an assistant message needs its text as content, or tool_calls (this "
                               "server keeps no replies to look up by an audio id)")
        _check_tool_fields(message, role, where)
        if isinstance(content, str) or content is None:
            parts = self._text(content or "", f"{where}.content")
        else:
            parts = [p for i, part in enumerate(content) for p in self._part(part, f"{where}.content[{i}]")]
        if role != "user" and not all(isinstance(p, str) for p in parts):
            raise RequestError(f"{where}: only a user message may hold images, audio or videos")
        if role == "user" and not parts:
            raise RequestError(f"{where}: the message is empty")
        if message.reasoning_content is not None and role != "assistant":
            raise RequestError(f"{where}: only an assistant message may hold reasoning_content")
        reasoning = message.reasoning_content or ""
        check_text(reasoning, f"{where}.reasoning_content")
        calls = tool_calls(message.tool_calls or [], f"{where}.tool_calls")
        return Message(role, parts, reasoning=reasoning, tool_calls=calls, tool_call_id=message.tool_call_id)

    def _part(self, part: TextPart | ImagePart | AudioPart | VideoPart, where: str) -> list[Part]:
        if isinstance(part, TextPart):
            return self._text(part.text, where)
        if isinstance(part, ImagePart):
            return [load_image(self._file(part.image_url.url, where, "image"), self.limits, name=where)]
        if isinstance(part, AudioPart):
            return [load_audio(_base64(part.input_audio.data, where), self.limits, name=where)]
        return [self.read_video(self._file(part.video_url.url, where, "video"))]

    @staticmethod
    def _text(text: str, where: str) -> list[Part]:
        check_text(text, where)
        return [text] if text else []

    def _file(self, url: str, where: str, kind: str) -> bytes | Path:
        """A data URL's bytes, or the path a file URL names."""
        scheme = urlparse(url).scheme.lower()
        if scheme == "data":
            return _base64(url, where)
        if scheme in ("http", "https"):
            raise RequestError(f"{where}: this server does not fetch URLs: send the {kind} in the request, as a data "
                               f"URL (data:{kind}/...;base64,...)")
        if scheme not in ("file", ""):
            raise RequestError(f"{where}: a {scheme}: URL is not taken: send the {kind} as a data URL")
        if not self.local_files:
            raise RequestError(f"{where}: files on the server are not read (api_local_files = false): send the "
                               f"{kind} as a data URL")
        return Path(unquote(urlparse(url).path) if scheme == "file" else url)


def _check_tool_fields(message: ChatMessage, role: Role, where: str) -> None:
    """tool_calls on an assistant message alone; a tool message with the id of the call it answers."""
    if message.tool_calls and role != "assistant":
        raise ApiError(400, f"{where}.tool_calls: only an assistant message makes tool calls",
                       param=f"{where}.tool_calls")
    if (message.tool_call_id is not None) != (role == "tool"):
        field = f"{where}.tool_call_id"
        why = "a tool message needs the id of the call it answers" if role == "tool" else \
            "only a tool message answers a call"
        raise ApiError(400, f"{field}: {why}", param=field)


def _base64(data: str, where: str) -> bytes:
    """The bytes of base64 text, or of a base64 data URL."""
    if data.startswith("data:"):
        header, comma, data = data.partition(",")
        if not comma or not header.endswith(";base64"):
            raise RequestError(f"{where}: a data URL must be base64 (data:TYPE;base64,DATA)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data is not valid base64") from None
