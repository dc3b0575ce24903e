"""The chat as the page shows it, and as the model sees it.

Gradio keeps the visible history; each turn rebuilds the conversation from it, so retry, undo and
edit (built into ChatInterface; an edited question keeps its files by edits.py) need nothing more. The shown chat keeps a `ChatMemory`: its
session id (the saved chat's id), so every turn continues its own prefix-cache entry, and each
reply's token ids, so the next prompt holds the reply exactly as generated and its cached KV is
reused in full. A Thinking checkpoint's reasoning is a titled message before its answer, which
Gradio folds (open while it streams); the model is given it back apart from the answer. Errors
appear as a marked message in the chat and are left out of what the model sees. The WAV files a
chat shows and owns, its spoken replies and voice questions, are written here.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import soundfile
from PIL import Image

from omni_local.api import OmniLocal
from omni_local.errors import RequestError
from omni_local.media import load_audio, load_image
from omni_local.media.video import Video, VideoFile
from omni_local.metrics_line import metrics_line
from omni_local.protocol.events import SPEECH_SAMPLE_RATE, Finished
from omni_local.protocol.messages import Message, Part, reply_key
from omni_local.ui.access import upload_folder
from omni_local.ui.messages import block_text, blocks, file_path
from omni_local.ui.turn import Turn
from omni_local.ui.uploads import check_own

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"}
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".mp3"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mov"}
ERROR_TITLE = "Error"
REASONING_TITLE = "Reasoning"
SPOKEN_TITLE = "Spoken reply"
# WAV files the app writes into the uploads folder, files of one chat's own (deleted with it).
REPLY_PREFIX = "reply-"  # a spoken reply; a voice question's is chats.UTTERANCE_PREFIX
# Decoded uploads a chat keeps, the most recently used, so that each turn does not read every
# earlier file again. Bounded: a long chat of videos would otherwise hold every decoded frame for as
# long as its page is open. One read back costs a decode; the file is unchanged.
KEPT_MEDIA_BYTES = 512 << 20


@dataclass
class ChatMemory:
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    replies: dict[str, list[int]] = field(default_factory=dict)  # reply_key(answer, reasoning) -> its token ids
    media: dict[str, Part] = field(default_factory=dict)  # upload path -> decoded, the most recently used last
    left: bool = False  # the page has opened another chat: this one's reply must not show there
    deleted: bool = False  # the chat was deleted: nothing saves it again
    revision: int = 0  # the saved chat's revision this page has: an older one means another tab changed it
    user: str | None = None  # who is logged in (None without a login): whose chats folder this chat is in
    turn: Turn | None = None  # the typed turn streaming in this page, if any

    def __deepcopy__(self, memo: dict[int, Any]) -> "ChatMemory":
        """A new chat's memory copies to another new chat's, of its own id: gr.State deep-copies its
        default for each page (a callable default would be called instead, but Gradio does that in a
        page-load event of its own, which can end after the page's start-up event has set the
        memory of the chat it shows, and the page then saved that chat's next turn as a new chat).
        A memory in use is never copied by Gradio; its copy shares the decoded media and turn."""
        if self == ChatMemory(session_id=self.session_id):
            return ChatMemory()
        return replace(self, replies=dict(self.replies), media=dict(self.media))

    def remember(self, path: str, part: Part) -> None:
        """Keep `part`, decoded from `path`, dropping the least recently used past KEPT_MEDIA_BYTES."""
        known = self.media.pop(path, None) is not None
        self.media[path] = part
        if known:
            return  # used again: now the most recent, and the total is what it was
        total = sum(map(_nbytes, self.media.values()))
        while len(self.media) > 1 and total > KEPT_MEDIA_BYTES:
            total -= _nbytes(self.media.pop(next(iter(self.media))))


def streaming_reply(reasoning: str, text: str) -> str | list[gr.ChatMessage]:
    """A reply as it streams: its text, or, once it reasoned, its reasoning, open until the answer
    begins, then folded above the answer so far. (Reasoning of white space alone is none, as for
    reply_key.)"""
    if not reasoning.strip():
        return text
    return [reasoning_message(reasoning, streaming=not text), *([gr.ChatMessage(content=text)] if text else [])]


def waiting_note(ahead: int) -> str:
    """What a reply's place shows while the engine runs others: `ahead` replies before it."""
    return f"_Waiting for {ahead} {'reply' if ahead == 1 else 'replies'} ahead…_"


def saved_streaming_reply(reasoning: str, text: str) -> list[dict[str, Any]]:
    """A reply still streaming as its chat is saved: its reasoning folded, as a reloaded page shows
    a reply that no longer streams."""
    saved = [as_dict(reasoning_message(reasoning, streaming=False))] if reasoning.strip() else []
    if text or not saved:
        saved.append({"role": "assistant", "content": text})
    return saved


def reply_messages(reasoning: str, text: str) -> list[gr.ChatMessage]:
    """A reply's reasoning, folded, then its answer; a reply stopped while it reasoned has no answer
    shown, and one without reasoning is its answer alone."""
    shown = [reasoning_message(reasoning, streaming=False)] if reasoning.strip() else []
    return shown + [gr.ChatMessage(content=text)] if text or not shown else shown


def reasoning_message(reasoning: str, streaming: bool) -> gr.ChatMessage:
    """A reply's reasoning, a titled message: Gradio shows it open while its status is pending and
    folds it once done."""
    return gr.ChatMessage(content=reasoning, metadata={"title": REASONING_TITLE,
                                                       "status": "pending" if streaming else "done"})


def finished_reply(event: Finished, audio: np.ndarray, uploads: Path, memory: ChatMemory) -> list[gr.ChatMessage]:
    """A finished reply as the chat shows it: its reasoning (folded), its text, its speech (kept in
    `uploads`, to play again) and its metrics. Its token ids are remembered for the next turn's
    prompt. A reply stopped while it reasoned shows its reasoning and no answer."""
    if event.token_ids is not None:  # a remote server's replies have none: the next prompt sends their text
        memory.replies[reply_key(event.text, event.reasoning)] = event.token_ids
    shown = reply_messages(event.reasoning, event.text)
    kept = keep_audio(uploads, audio) if audio.size else None
    if kept is not None:
        shown.append(gr.ChatMessage(content={"path": str(kept)}, metadata={"title": SPOKEN_TITLE}))
    shown.append(gr.ChatMessage(content=metrics_line(event), metadata={"title": "Metrics"}))
    return shown


def keep_wav(folder: Path, prefix: str, samples: np.ndarray, rate: int, subtype: str) -> Path:
    """`samples` as a new WAV file in `folder` (the private uploads folder), named `prefix` and a
    random id. Raises OSError, or RuntimeError: soundfile's report of a failed write (a full disk)."""
    path = folder / f"{prefix}{uuid.uuid4().hex}.wav"
    soundfile.write(path, samples, rate, subtype=subtype, format="WAV")
    return path


def keep_audio(folder: Path, samples: np.ndarray) -> Path | None:
    """A spoken reply as a WAV file in the private uploads folder, for the chat to play again; None
    (and a warning on the page) if the disk will not take it."""
    try:
        return keep_wav(folder, REPLY_PREFIX, samples, SPEECH_SAMPLE_RATE, "PCM_16")
    except (OSError, RuntimeError) as error:
        gr.Warning(f"The spoken reply could not be kept to play again: {error}")
        return None


def error_message(text: str) -> gr.ChatMessage:
    return gr.ChatMessage(content=text, metadata={"title": ERROR_TITLE})


def as_dict(message: gr.ChatMessage) -> dict[str, Any]:
    """An assistant message in the form the chat's history holds it."""
    return {"role": "assistant", "content": message.content, "metadata": dict(message.metadata or {})}


def question(message: dict[str, Any]) -> dict[str, Any]:
    """A submitted message as the chat shows it: its files, then its text."""
    files = [{"path": item if isinstance(item, str) else item["path"]} for item in message.get("files") or []]
    return {"role": "user", "content": [*files, *([message["text"]] if message.get("text") else [])]}


def to_messages(history: list[dict[str, Any]], app: OmniLocal, memory: ChatMemory | None = None) -> list[Message]:
    """Gradio's visible history as the model's conversation: only questions that got a reply.

    Gradio 6 keeps one user entry per turn (text and files together). A question answered by an
    error, or by nothing (stopped early), never reached the model: it is dropped before its files
    are read, so a bad upload cannot fail every later turn. A reply is its reasoning message (if it
    reasoned) and its answer, one assistant message; error, speech and metrics notes are left out.
    """
    memory = memory or ChatMemory()

    def parts(message: dict[str, Any]) -> list[Part]:
        return _parts(message, lambda path: _remembered(path, app, memory))

    def add(reply: Message, entry: dict[str, Any], title: str | None) -> None:
        if title == REASONING_TITLE:
            reply.reasoning += "".join(text for block in blocks(entry) if (text := block_text(block)) is not None)
        else:
            reply.parts += parts(entry)

    messages: list[Message] = []
    asked: dict[str, Any] | None = None  # the last user entry, until its reply comes
    for entry in history:
        title = (entry.get("metadata") or {}).get("title")
        if entry["role"] == "user":
            asked = entry
        elif title == ERROR_TITLE:
            asked = None
        elif title and title != REASONING_TITLE:
            continue
        elif asked is not None:  # the reply begins: its reasoning, or its answer
            messages += [Message("user", sorted(parts(asked), key=_send_order)), Message("assistant")]
            add(messages[-1], entry, title)
            asked = None
        elif messages:
            add(messages[-1], entry, title)  # one reply shown as several messages
    for reply in messages[1::2]:  # questions and replies, in turn
        reply.token_ids = memory.replies.get(reply_key(reply.text, reply.reasoning))
    return messages


def _send_order(part: Part) -> int:
    """A question's parts in the order `Session.send` gives them (images, sounds, videos, text), so
    a turn rebuilt from the page is the prompt that turn was sent as, and its cached KV matches."""
    kinds = (Image.Image, np.ndarray, (Video, VideoFile))
    return next((rank for rank, kind in enumerate(kinds) if isinstance(part, kind)), len(kinds))


def _parts(message: dict[str, Any], load: Callable[[str], Part]) -> list[Part]:
    parts: list[Part] = []
    for block in blocks(message):
        path, text = file_path(block), block_text(block)
        if path is not None:
            parts.append(load(path))
        elif text is not None:
            parts.append(text)
    return parts


def decoded_media(files: list[Any], app: OmniLocal, memory: ChatMemory) -> dict[str, list[Part]]:
    """A message's files, decoded (and kept for its chat's next turns), by kind as `Session.send`
    takes them."""
    media: dict[str, list[Part]] = {"images": [], "audio": [], "videos": []}
    for item in files:
        path = item if isinstance(item, str) else item["path"]
        media[_kind(Path(path))].append(_remembered(path, app, memory))
    return media


def _remembered(path: str, app: OmniLocal, memory: ChatMemory) -> Part:
    """An upload decoded once while its chat keeps it: Gradio keeps each upload at its own path,
    unchanged. Another user's upload is refused, as a missing file (ui/uploads.py)."""
    check_own(path, upload_folder(app.settings), memory.user)
    part = memory.media[path] if path in memory.media else _load(path, app)
    memory.remember(path, part)
    return part


def _nbytes(part: Part) -> int:
    if isinstance(part, Image.Image):
        return part.width * part.height * len(part.getbands())
    if isinstance(part, Video):
        return part.frames.nbytes + (part.audio.nbytes if part.audio is not None else 0)
    if isinstance(part, VideoFile):
        return len(part.data)
    return part.nbytes


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
