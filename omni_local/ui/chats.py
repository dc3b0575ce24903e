"""Saved chats: each one a JSON file in the app's private folder, so they survive a reload of the
page and a restart of the app.

A chat keeps what the page shows (Gradio's messages, with the paths of uploads, which stay in the
private uploads folder), its system prompt, its title, and each reply's token ids: the next turn's
prompt then holds every reply exactly as generated, and the chat's id is its prefix-cache session,
so its KV is continued in place. JSON only: nothing read from disk is ever unpickled.
"""

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omni_local.cache.folders import private_folder
from omni_local.ui.messages import block_text, blocks

TITLE_CHARS = 40


@dataclass
class SavedChat:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    title: str = ""  # empty until the first question (or a rename) names it
    system_prompt: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)  # Gradio's messages
    replies: dict[str, list[int]] = field(default_factory=dict)  # reply text -> its token ids
    updated: float = field(default_factory=time.time)

    @property
    def shown_title(self) -> str:
        return self.title or first_question(self.history) or "New chat"


def first_question(history: list[dict[str, Any]]) -> str:
    for message in history:
        if message.get("role") == "user":
            text = " ".join(text for block in blocks(message) if (text := block_text(block)) is not None).strip()
            if text:
                return text if len(text) <= TITLE_CHARS else text[: TITLE_CHARS - 1] + "…"
    return ""


class ChatStore:
    """The chats of one app: it alone writes the folder while it runs."""

    def __init__(self, folder: Path) -> None:
        self.folder = private_folder(folder)
        # Each chat's shown title and last use, for the sidebar's list. The page saves a chat at each
        # streamed update of a reply; reading every file there instead cost 20 ms per update with
        # 100 chats (2-core CPU), most of it parsing JSON under the GIL the engine's thread needs.
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
        chat.updated = time.time()
        path = self._path(chat.id)
        staging = path.with_suffix(".tmp")
        # Written beside it and renamed into place: a crash never leaves half a chat.
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                json.dump(asdict(chat), file)
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)  # renamed away, or half written (a full disk): never left behind
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
        try:
            return SavedChat(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None
