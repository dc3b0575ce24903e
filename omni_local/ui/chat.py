"""The chat UI: a Gradio 6 ChatInterface over the engine, with a sidebar of saved chats.

Gradio keeps the visible history; each turn rebuilds the conversation from it, so retry, undo and
edit (built into ChatInterface) need nothing from us. The shown chat keeps a `ChatMemory`: its
session id (the saved chat's id), so every turn continues its own prefix-cache entry, and each
reply's token ids, so the next prompt holds the reply exactly as generated and its cached KV is
reused in full. Chats are saved as they change (chats.py) and come back after a reload or a
restart. Errors appear as a marked message in the chat, are left out of what the model sees, and
the chat goes on.
"""

import base64
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline and private by default

import gradio as gr
import numpy as np
import soundfile
from PIL import Image

from omni_local.api import OmniLocal
from omni_local.cache.folders import private_folder
from omni_local.engine.request import AudioChunk, Finished, TextDelta
from omni_local.engine.vocoder import SAMPLE_RATE as SPEECH_SAMPLE_RATE
from omni_local.errors import OmniLocalError, RequestError
from omni_local.media import load_audio, load_image
from omni_local.media.video import Video
from omni_local.prompts import Message, Part
from omni_local.ui.chats import ChatStore, SavedChat

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mov"}
ERROR_TITLE = "Error"
SPOKEN_TITLE = "Spoken reply"
# Plays each chunk of a spoken reply right after the one before, as it arrives: Gradio's own
# streamed audio encodes to AAC and plays through HLS (first sound 1.3 s after submit in an earlier
# test here, with an instant server). A chunk numbered 0
# starts a new reply and cuts whatever still plays.
PLAYER_JS = """
(payload) => {
  if (!payload || payload.pcm === undefined) return;
  const player = (window.omniLocalPlayer ??= {context: new AudioContext(), end: 0, sources: []});
  player.context.resume();
  if (payload.index === 0) {
    player.sources.forEach((source) => { try { source.stop(); } catch (error) {} });
    player.sources = [];
    player.end = 0;
  }
  const bytes = Uint8Array.from(atob(payload.pcm), (c) => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer);
  const buffer = player.context.createBuffer(1, pcm.length, payload.rate);
  const channel = buffer.getChannelData(0);
  for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32768;
  const source = player.context.createBufferSource();
  source.buffer = buffer;
  source.connect(player.context.destination);
  const start = Math.max(player.end, player.context.currentTime);
  source.start(start);
  player.end = start + buffer.duration;
  player.sources.push(source);
  // When it reached the page and when it starts to sound, after the server sent it (seconds).
  const now = Date.now() / 1000;
  (window.omniLocalChunks ??= []).push({index: payload.index, arrived: now - payload.sent_at,
                                        sounds: now - payload.sent_at + (start - player.context.currentTime)});
}
"""


@dataclass
class ChatMemory:
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    replies: dict[str, list[int]] = field(default_factory=dict)  # reply text -> its token ids
    media: dict[str, Part] = field(default_factory=dict)  # upload path -> decoded, so each is read once


def build_ui(app: OmniLocal, store: ChatStore | None = None) -> gr.Blocks:
    """The chat page: the chat itself, and a sidebar of saved chats (`store`, by default in
    `<cache_dir>/chats`)."""
    store = store or ChatStore(app.settings.cache_path / "chats")
    uploads = private_folder(app.settings.cache_path / "uploads")
    voices = sorted(name.capitalize() for name in app.engine.speaker.runner.voices) if app.engine.speaker else []

    def respond(
        message: dict[str, Any],
        history: list[dict[str, Any]],
        system_prompt: str,
        memory: ChatMemory,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
        speak: bool,
        voice: str,
    ) -> Iterator[tuple[Any, Any]]:
        """Yields (what the chat shows, the next audio chunk for the page's player or gr.skip())."""
        try:
            session = app.session(system_prompt=system_prompt or None, session_id=memory.session_id)
            session.history += to_messages(history, app, memory)
            options = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p}
            if speak:
                options |= {"speak": True, "voice": voice}
            reply = session.send(message.get("text") or "", **_media(message.get("files") or []), **options)
        except OmniLocalError as error:
            yield _error_message(str(error)), gr.skip()
            return
        text, chunks = "", 0
        try:
            for event in reply:
                if isinstance(event, TextDelta):
                    text += event.text
                    yield text, gr.skip()
                elif isinstance(event, AudioChunk):
                    yield text, _audio_payload(event, chunks)
                    chunks += 1
                elif isinstance(event, Finished):
                    memory.replies[event.text] = event.token_ids
                    shown = [gr.ChatMessage(content=event.text)]
                    kept = _keep_audio(uploads, reply.audio) if reply.audio.size else None
                    if kept is not None:  # in the chat, to play again
                        shown.append(gr.ChatMessage(content={"path": str(kept)}, metadata={"title": SPOKEN_TITLE}))
                    shown.append(gr.ChatMessage(content=event.metrics_line(), metadata={"title": "Metrics"}))
                    _keep(store, [*history, _question(message), *map(_as_dict, shown)], system_prompt, memory)
                    yield shown, gr.skip()
        except OmniLocalError as error:
            yield _error_message(str(error)), gr.skip()
        finally:
            reply.cancel()  # the stop button closes this generator: stop the engine's work too

    textbox = gr.MultimodalTextbox(
        file_types=sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES),
        file_count="multiple",
        sources=["upload", "microphone"],
        placeholder="Ask something, or drop an image, audio or video file here",
    )
    with gr.Blocks(title="omni_local") as ui:
        memory = gr.State(lambda: ChatMemory())
        # Each spoken chunk as it comes; the page plays it at once (Web Audio, below).
        audio_feed = gr.JSON(visible=False)
        # Rendered by ChatInterface, under "Additional inputs".
        system = gr.Textbox(label="System prompt", lines=2, render=False)
        with gr.Sidebar(label="Chats", open=True):
            new_chat = gr.Button("New chat", variant="primary")
            # Any saved chat's id is accepted (a page or API client opened before it was saved
            # has not been sent it as a choice); an unknown one opens a new chat.
            chooser = gr.Dropdown(label="Chats", choices=[], allow_custom_value=True)
            title = gr.Textbox(label="Title", placeholder="Rename this chat")
            with gr.Row():
                rename = gr.Button("Rename", size="sm")
                delete = gr.Button("Delete", size="sm", variant="stop")
        chat = gr.ChatInterface(
            respond,
            multimodal=True,
            textbox=textbox,
            additional_inputs=[
                system,
                memory,
                # A reply can use whatever the context leaves after the prompt.
                gr.Slider(1, app.settings.max_context_tokens, value=app.settings.max_new_tokens, step=1,
                          label="Longest reply (tokens)", render=False),
                gr.Slider(0.0, 2.0, value=app.settings.temperature, step=0.05, label="Temperature (0 is greedy)",
                          render=False),
                gr.Slider(0.05, 1.0, value=app.settings.top_p, step=0.05, label="Top-p", render=False),
                gr.Checkbox(value=False, render=False, interactive=bool(voices),
                            label="Speak replies" if voices else "Speak replies (start the app with --speech true)"),
                # An unknown voice is the engine's clear error, like any request's.
                gr.Dropdown(voices, value=app.settings.voice, label="Voice", allow_custom_value=True, render=False),
            ],
            additional_outputs=[audio_feed],
            title="omni_local",
            editable=True,
            api_name="chat",
        )
        # The shown messages, and ChatInterface's own copy its API endpoint answers from.
        shown = [chat.chatbot, chat.chatbot_state, system, memory, chooser, title]
        audio_feed.change(None, [audio_feed], None, js=PLAYER_JS)
        chat.chatbot.change(lambda *a: _keep(store, *a), [chat.chatbot, system, memory], [chooser],
                            trigger_mode="always_last", show_progress="hidden", api_name=False)
        chooser.input(lambda chat_id: _show(store, store.get(chat_id)), [chooser], shown, api_name="open_chat")
        new_chat.click(lambda: _show(store, None), None, shown, api_name="new_chat")
        rename.click(lambda text, m: _rename(store, text, m), [title, memory], [chooser], api_name="rename_chat")
        delete.click(lambda m: _delete(store, uploads, m), [memory], shown, api_name="delete_chat")
        ui.load(lambda: _show(store, next(iter(store.all()), None)), None, shown, api_name=False)
    return ui


def _keep(store: ChatStore, history: list[dict[str, Any]], system_prompt: str, memory: ChatMemory) -> Any:
    """Save the chat (not before its first question): after each answer, and as the page changes it
    (undo, edit); the list then shows it first."""
    if not history:
        return gr.update()
    saved = store.get(memory.session_id) or SavedChat(id=memory.session_id)
    kept = (saved.history, saved.system_prompt, saved.replies)
    saved.history, saved.system_prompt, saved.replies = history, system_prompt or "", dict(memory.replies)
    # Unchanged when the page echoes an answer the chat already saved: no second write.
    if kept != (saved.history, saved.system_prompt, saved.replies):
        try:
            store.save(saved)
        except OSError as error:  # a full or read-only disk: the chat goes on, unsaved, and says so
            gr.Warning(f"This chat could not be saved: {error.strerror or error}")
    return _chooser(store, saved.id)


def _audio_payload(chunk: AudioChunk, index: int) -> dict[str, Any]:
    """A chunk for the page's player: 16-bit PCM in base64, which JSON carries."""
    pcm = (np.clip(chunk.samples, -1.0, 1.0) * 32767).astype("<i2")
    return {"index": index, "rate": chunk.sample_rate, "pcm": base64.b64encode(pcm.tobytes()).decode("ascii"),
            "sent_at": time.time()}  # wall clock, so the page can tell how long the chunk took to reach it


def _keep_audio(folder: Path, samples: np.ndarray) -> Path | None:
    """A spoken reply as a WAV file in the private uploads folder, for the chat to play again; None
    (and a warning on the page) if the disk will not take it."""
    path = folder / f"reply-{uuid.uuid4().hex}.wav"
    try:
        soundfile.write(path, samples, SPEECH_SAMPLE_RATE, subtype="PCM_16", format="WAV")
    except (OSError, RuntimeError) as error:  # soundfile reports a failed write as RuntimeError
        gr.Warning(f"The spoken reply could not be kept to play again: {error}")
        return None
    return path


def _question(message: dict[str, Any]) -> dict[str, Any]:
    """A submitted message as the chat shows it: its files, then its text."""
    files = [{"path": item if isinstance(item, str) else item["path"]} for item in message.get("files") or []]
    return {"role": "user", "content": [*files, *([message["text"]] if message.get("text") else [])]}


def _as_dict(message: gr.ChatMessage) -> dict[str, Any]:
    return {"role": "assistant", "content": message.content, "metadata": dict(message.metadata or {})}


def _show(store: ChatStore, saved: SavedChat | None) -> tuple[Any, ...]:
    """The page for `saved`, or a new empty chat: its messages, system prompt, memory (its id is
    its cache session), the list and its title."""
    saved = saved or SavedChat()
    memory = ChatMemory(session_id=saved.id, replies=dict(saved.replies))
    return saved.history, saved.history, saved.system_prompt, memory, _chooser(store, saved.id), saved.title


def _rename(store: ChatStore, text: str, memory: ChatMemory) -> Any:
    saved = store.get(memory.session_id)
    if saved is not None:
        saved.title = text.strip()
        store.save(saved)
    return _chooser(store, memory.session_id)


def _delete(store: ChatStore, uploads: Path, memory: ChatMemory) -> tuple[Any, ...]:
    """Delete the shown chat, and the spoken replies it kept (files of its own: uploads may be shared
    with other chats, since Gradio keeps one file per content)."""
    saved = store.get(memory.session_id)
    for message in saved.history if saved else []:
        if (message.get("metadata") or {}).get("title") == SPOKEN_TITLE:
            path = Path(_file_path(message.get("content")) or "")
            if path.parent == uploads and path.name.startswith("reply-"):
                path.unlink(missing_ok=True)
    store.delete(memory.session_id)
    return _show(store, next(iter(store.all()), None))


def _chooser(store: ChatStore, selected: str) -> Any:
    chats = store.all()
    choices = [(chat.shown_title, chat.id) for chat in chats]
    return gr.update(choices=choices, value=selected if any(chat.id == selected for chat in chats) else None)


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
    kinds = (Image.Image, np.ndarray, Video)
    return next((rank for rank, kind in enumerate(kinds) if isinstance(part, kind)), len(kinds))


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
