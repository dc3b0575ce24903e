"""The first chat UI: a Gradio 6 ChatInterface over the engine.

Gradio keeps the visible history; each turn rebuilds the conversation from it, so retry, undo and
edit (built into ChatInterface) need nothing from us. Each browser chat keeps a `ChatMemory`: its
session id, so every turn continues the same prefix-cache entry, and each reply's token ids, so
the next prompt holds the reply exactly as generated and its cached KV is reused in full. Errors
appear as a marked message in the chat, are left out of what the model sees, and the chat goes on.
"""

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline and private by default

import gradio as gr
import numpy as np
from PIL import Image

from omni_local.api import OmniLocal
from omni_local.engine.request import Finished, TextDelta
from omni_local.errors import OmniLocalError, RequestError
from omni_local.media import load_audio, load_image
from omni_local.media.video import Video
from omni_local.prompts import Message, Part

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mov"}
ERROR_TITLE = "Error"


@dataclass
class ChatMemory:
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    replies: dict[str, list[int]] = field(default_factory=dict)  # reply text -> its token ids
    media: dict[str, Part] = field(default_factory=dict)  # upload path -> decoded, so each is read once


def build_ui(app: OmniLocal) -> gr.Blocks:
    def respond(
        message: dict[str, Any],
        history: list[dict[str, Any]],
        system_prompt: str,
        memory: ChatMemory,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
    ) -> Iterator[Any]:
        try:
            session = app.session(system_prompt=system_prompt or None, session_id=memory.session_id)
            session.history += to_messages(history, app, memory)
            sampling = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p}
            reply = session.send(message.get("text") or "", **_media(message.get("files") or []), **sampling)
        except OmniLocalError as error:
            yield _error_message(str(error))
            return
        text = ""
        try:
            for event in reply:
                if isinstance(event, TextDelta):
                    text += event.text
                    yield text
                elif isinstance(event, Finished):
                    memory.replies[event.text] = event.token_ids
                    yield [gr.ChatMessage(content=event.text), gr.ChatMessage(content=event.metrics_line(),
                                                                              metadata={"title": "Metrics"})]
        except OmniLocalError as error:
            yield _error_message(str(error))
        finally:
            reply.cancel()  # the stop button closes this generator: stop the engine's work too

    textbox = gr.MultimodalTextbox(
        file_types=sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES),
        file_count="multiple",
        sources=["upload", "microphone"],
        placeholder="Ask something, or drop an image, audio or video file here",
    )
    return gr.ChatInterface(
        respond,
        multimodal=True,
        textbox=textbox,
        additional_inputs=[
            gr.Textbox(label="System prompt", lines=2),
            gr.State(lambda: ChatMemory()),
            # A reply can use whatever the context leaves after the prompt.
            gr.Slider(1, app.settings.max_context_tokens, value=app.settings.max_new_tokens, step=1,
                      label="Longest reply (tokens)"),
            gr.Slider(0.0, 2.0, value=app.settings.temperature, step=0.05, label="Temperature (0 is greedy)"),
            gr.Slider(0.05, 1.0, value=app.settings.top_p, step=0.05, label="Top-p"),
        ],
        title="omni_local",
        editable=True,
        api_name="chat",
    )


def to_messages(history: list[dict[str, Any]], app: OmniLocal, memory: ChatMemory | None = None) -> list[Message]:
    """Gradio's visible history as the model's conversation: only questions that got a reply.

    Gradio 6 keeps one user entry per turn (text and files together). A question answered by an
    error, or by nothing (stopped early), never reached the model: it is dropped before its files
    are read, so a bad upload cannot fail every later turn. Error and metrics notes are left out.
    """
    memory = memory or ChatMemory()

    def parts(content: Any) -> list[Part]:
        return _parts(content, lambda path: _remembered(path, app, memory))

    messages: list[Message] = []
    question: dict[str, Any] | None = None  # the last user entry, until its reply comes
    for entry in history:
        title = (entry.get("metadata") or {}).get("title")
        if entry["role"] == "user":
            question = entry
        elif title == ERROR_TITLE:
            question = None
        elif title:
            continue
        elif question is not None:
            answer = parts(entry["content"])
            ids = memory.replies.get("".join(p for p in answer if isinstance(p, str)))
            question_parts = sorted(parts(question["content"]), key=_send_order)
            messages += [Message("user", question_parts), Message("assistant", answer, token_ids=ids)]
            question = None
        elif messages:
            messages[-1].parts += parts(entry["content"])  # one reply shown as several messages
    return messages


def _send_order(part: Part) -> int:
    """A question's parts in the order `Session.send` gives them (images, sounds, videos, text), so
    a turn rebuilt from the page is the prompt that turn was sent as, and its cached KV matches."""
    return 0 if isinstance(part, Image.Image) else 1 if isinstance(part, np.ndarray) else 2 if isinstance(part, Video) else 3


def _parts(content: Any, load: Callable[[str], Part]) -> list[Part]:
    blocks = content if isinstance(content, list) else [content]
    parts: list[Part] = []
    for block in blocks:
        path = _file_path(block)
        if path is not None:
            parts.append(load(path))
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block["text"])
        elif isinstance(block, str):
            parts.append(block)
    return parts


def _file_path(block: Any) -> str | None:
    if isinstance(block, dict):
        if block.get("type") == "file":
            block = block.get("file", block)
        return block.get("path")
    if isinstance(block, tuple) and block:
        return block[0]
    return None


def _media(files: list[Any]) -> dict[str, list[Path]]:
    media: dict[str, list[Path]] = {"images": [], "audio": [], "videos": []}
    for item in files:
        path = Path(item if isinstance(item, str) else item["path"])
        media[_kind(path)].append(path)
    return media


def _remembered(path: str, app: OmniLocal, memory: ChatMemory) -> Part:
    """An upload decoded once per chat: Gradio keeps each upload at its own path, unchanged."""
    if path not in memory.media:
        memory.media[path] = _load(path, app)
    return memory.media[path]


def _load(path: str, app: OmniLocal) -> Part:
    kind = _kind(Path(path))
    if kind == "videos":
        return app.read_video(path)
    return (load_image if kind == "images" else load_audio)(path, app.limits)


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "images"
    if suffix in AUDIO_SUFFIXES:
        return "audio"
    if suffix in VIDEO_SUFFIXES:
        return "videos"
    raise RequestError(f"{path.name}: unsupported file type (image, audio or video files expected)")


def _error_message(text: str) -> gr.ChatMessage:
    return gr.ChatMessage(content=text, metadata={"title": ERROR_TITLE})
