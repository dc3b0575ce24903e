"""Saved chats: each one a JSON file in the app's private folder, so they survive a reload of the
page and a restart of the app.

A chat keeps what the page shows (Gradio's messages, with the paths of uploads, which stay in the
private uploads folder), its system prompt, its title, and each reply's token ids: the next turn's
prompt then holds every reply exactly as generated, and the chat's id is its prefix-cache session,
so its KV is continued in place. JSON only: nothing read from disk is ever unpickled. With a login,
each user's chats are a folder of their own (`ChatShelves`): nobody lists or opens another's.
"""

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omni_local.folders import private_folder
from omni_local.protocol.messages import reply_key
from omni_local.ui.messages import block_text, blocks, file_path

TITLE_CHARS = 40
UTTERANCE_PREFIX = "voice-"  # a voice question's WAV file, which the app writes (history.py)

log = logging.getLogger(__name__)


@dataclass
class SavedChat:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    title: str = ""  # empty until the first question (or a rename) names it
    system_prompt: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)  # Gradio's messages
    replies: dict[str, list[int]] = field(default_factory=dict)  # reply_key(answer, reasoning) -> its token ids
    updated: float = field(default_factory=time.time)
    created: float = field(default_factory=time.time)
    revision: int = 0  # saves so far: a page that saw an older one has missed another tab's change
    context_tokens: int = 0  # prompt and reply tokens of the last counted turn: how full the context is
    # Each question's turn's context use, in the chat's order (0: not counted), so that an undo
    # shows the use of the turn it goes back to.
    turn_contexts: list[int] = field(default_factory=list)

    def update(self, history: list[dict[str, Any]], context_tokens: int | None) -> None:
        """The chat is now `history`, whose last turn filled `context_tokens` of the context (None:
        not counted, or not yet). Its context use is its last counted turn's: after an undo, that
        of the turn it went back to; with no question left, none."""
        asked = sum(message.get("role") == "user" for message in history)
        counts = self.turn_contexts[:asked]
        if context_tokens is not None and asked:
            counts += [0] * (asked - len(counts))
            counts[asked - 1] = context_tokens
        self.history, self.turn_contexts = history, counts
        self.context_tokens = next((count for count in reversed(counts) if count), 0)

    @property
    def shown_title(self) -> str:
        return (self.title or first_question(self.history) or self._voice_title() or self._file_title()
                or "New chat")

    def _voice_title(self) -> str:
        """"Voice chat, 14:05" for a chat that began with a recording and no text."""
        spoken = any(Path(file_path(block) or "").name.startswith(UTTERANCE_PREFIX)
                     for message in self.history[:1] for block in blocks(message))
        return f"Voice chat, {time.strftime('%H:%M', time.localtime(self.created))}" if spoken else ""

    def _file_title(self) -> str:
        """The first file's name, for a chat that began with files and no text (a clip to caption)."""
        names = [Path(path).name for message in self.history[:1] for block in blocks(message)
                 if (path := file_path(block))]
        return _cut(names[0]) if names else ""


def first_question(history: list[dict[str, Any]]) -> str:
    """The first words of the first typed question, on one line, cut to TITLE_CHARS."""
    for message in history:
        if message.get("role") == "user":
            words = " ".join(text for block in blocks(message) if (text := block_text(block)) is not None).split()
            text = " ".join(words)
            if text:
                return _cut(text)
    return ""


def _cut(title: str) -> str:
    return title if len(title) <= TITLE_CHARS else title[: TITLE_CHARS - 1] + "…"


class ChatStore:
    """The chats of one user of one app: it alone writes the folder while it runs."""

    def __init__(self, folder: Path) -> None:
        self.folder = private_folder(folder)
        # Guards a chat's revision between reading and writing it: two tabs may save one chat at once.
        self.lock = threading.Lock()
        # Each chat's shown title and last use, for the sidebar's list. The page saves a chat as a
        # reply streams; reading every file there instead cost 20 ms per save with 100 chats (2-core
        # CPU), most of it parsing JSON under the GIL the engine's thread needs.
        self._index = {chat.id: (chat.shown_title, chat.updated) for chat in self.all()}

    def all(self) -> list[SavedChat]:
        """Every saved chat, the most recently used first; unreadable files are skipped."""
        chats = [chat for path in self.folder.glob("*.json") if (chat := self._read(path)) is not None]
        return sorted(chats, key=lambda chat: chat.updated, reverse=True)

    def titles(self) -> list[tuple[str, str]]:
        """(shown title, id) of every saved chat, the most recently used first; no file is read."""
        recent_first = sorted(self._index.items(), key=lambda item: item[1][1], reverse=True)
        return [(title, chat_id) for chat_id, (title, _) in recent_first]

    def latest(self) -> SavedChat | None:
        """The most recently used chat, or None if there is none."""
        return next((chat for _, chat_id in self.titles() if (chat := self.get(chat_id)) is not None), None)

    def get(self, chat_id: str) -> SavedChat | None:
        """The chat, or None if there is none by that id (an id not of ours names no file)."""
        return self._read(self._path(chat_id)) if chat_id.isalnum() else None

    def save(self, chat: SavedChat) -> None:
        """Write `chat`, one revision on. Raises OSError (a full or read-only disk); the chat's file
        is then as it was."""
        chat.updated = time.time()
        chat.revision += 1
        path = self._path(chat.id)
        staging = path.with_suffix(".tmp")
        # Written beside it and renamed into place: a crash never leaves half a chat.
        try:
            descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                json.dump(asdict(chat), file)
            os.replace(staging, path)
        except OSError:
            chat.revision -= 1
            staging.unlink(missing_ok=True)  # a disk that filled up mid-write keeps no half file
            raise
        self._index[chat.id] = (chat.shown_title, chat.updated)

    def delete(self, chat_id: str) -> None:
        self._path(chat_id).unlink(missing_ok=True)
        self._index.pop(chat_id, None)

    def _path(self, chat_id: str) -> Path:
        if not chat_id.isalnum():  # ids are ours (uuid hex); anything else never names a file
            raise ValueError(f"not a chat id: {chat_id!r}")
        return self.folder / f"{chat_id}.json"

    @staticmethod
    def _read(path: Path) -> SavedChat | None:
        """The chat in `path`, or None, with a warning, if the file is not one of ours: unreadable,
        not JSON, or JSON of another shape. One bad file must not stop the app or hide the others."""
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
            chat = SavedChat(**fields)
            problem = _shape_problem(chat)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as error:
            problem = str(error)
        if problem:
            log.warning("saved chat %s skipped: %s", path.name, problem)
            return None
        # Older files kept replies' texts as made. A key with a NUL, a reasoned reply's, was made by
        # reply_key as it is (and made again from the whole key could differ).
        chat.replies = {text if "\0" in text else reply_key(text): ids for text, ids in chat.replies.items()}
        return chat


def _shape_problem(chat: SavedChat) -> str:
    """What is wrong with a chat read from disk, or "" if it has the shape the app writes."""
    texts = (chat.id, chat.title, chat.system_prompt)
    if not all(isinstance(text, str) for text in texts) or not chat.id.isalnum():
        return "its id, title or system prompt is not text"
    if not isinstance(chat.history, list) or not all(
        isinstance(message, dict) and message.get("role") in ("user", "assistant") and "content" in message
        for message in chat.history
    ):
        return "its history is not a list of messages"
    if not isinstance(chat.replies, dict) or not all(
        isinstance(text, str) and isinstance(ids, list) and all(type(token) is int for token in ids)
        for text, ids in chat.replies.items()
    ):
        return "its replies are not texts with token ids"
    numbers = (chat.updated, chat.created, chat.revision, chat.context_tokens)
    if not all(isinstance(number, (int, float)) and not isinstance(number, bool) for number in numbers):
        return "its times or counts are not numbers"
    if not isinstance(chat.turn_contexts, list) or not all(type(count) is int for count in chat.turn_contexts):
        return "its turns' context use is not a list of counts"
    return ""


class ChatShelves:
    """Every user's chats. Without a login there is one user, whose chats are `root` itself; with
    one, each user's are a folder under it named by a digest of the name (any name, no path in it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stores: dict[str | None, ChatStore] = {}
        self._lock = threading.Lock()

    def of(self, user: str | None) -> ChatStore:
        with self._lock:
            if user not in self._stores:
                folder = self.root if user is None else self.root / f"user-{_digest(user)}"
                self._stores[user] = ChatStore(folder)
            return self._stores[user]


def _digest(user: str) -> str:
    return hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()
