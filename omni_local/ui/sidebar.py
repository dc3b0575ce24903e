"""The saved chats behind the page: saving the shown chat, the sidebar's list (titles as plain
text) and search, and its open, new, rename, clear and delete. Only a person's action writes:
asking (chat.py), undo, clear, rename, delete; opening or reloading the page never does."""

import re
from pathlib import Path
from typing import Any

import gradio as gr

from omni_local.ui.chats import UTTERANCE_PREFIX, ChatStore, SavedChat
from omni_local.ui.history import REPLY_PREFIX, ChatMemory
from omni_local.ui.messages import block_text, blocks, file_path

# Gradio has emptied the message box by then; the message shows above this, until the chat is opened again.
CHANGED_ELSEWHERE = ("This chat was changed in another tab or window since this page opened it, so your message "
                     "above was not sent or saved: copy it, then open the chat again from the list to go on.")


class ChatChangedElsewhere(Exception):
    """The saved chat has a revision this page has not seen: saving would lose another tab's turn."""


def keep(store: ChatStore, history: list[dict[str, Any]], system_prompt: str, memory: ChatMemory,
         context_tokens: int | None = None, shown_id: str = "") -> Any:
    """Save the shown chat (not before its first question, nor once deleted); the list then shows
    it first. `shown_id` is the chat the page showed with `history` ("" if not known): a change the
    page made before it opened another chat can arrive after the memory became the other chat's,
    and must not be saved as that chat. Raises ChatChangedElsewhere if another tab saved it since
    this page last did; a disk that will not take it is a warning, and the chat goes on."""
    if not history or memory.deleted or (shown_id and shown_id != memory.session_id):
        return gr.update()
    with store.lock:
        saved = store.get(memory.session_id) or SavedChat(id=memory.session_id)
        if saved.revision != memory.revision:
            raise ChatChangedElsewhere()
        kept = (saved.history, saved.system_prompt, saved.replies, saved.turn_contexts)
        saved.update(history, context_tokens)
        saved.system_prompt, saved.replies = system_prompt or "", dict(memory.replies)
        # Unchanged when an update repeats what the chat already saved: no second write.
        if kept != (saved.history, saved.system_prompt, saved.replies, saved.turn_contexts):
            try:
                store.save(saved)
                memory.revision = saved.revision
            except OSError as error:  # a full or read-only disk: the chat goes on, unsaved, and says so
                gr.Warning(f"This chat could not be saved: {error.strerror or error}")
    return chooser(store, saved.id)


def show(store: ChatStore, saved: SavedChat | None, user: str | None) -> tuple[Any, ...]:
    """The page for `saved`, or a new empty chat: its messages (twice: the page's and
    ChatInterface's copy), system prompt, memory (its id is its cache session), the list, its title
    and its context use."""
    saved = saved or SavedChat()
    memory = ChatMemory(session_id=saved.id, replies=dict(saved.replies), revision=saved.revision, user=user)
    return (saved.history, saved.history, saved.system_prompt, memory, chooser(store, saved.id), saved.title,
            saved.context_tokens)


def switch(store: ChatStore, saved: SavedChat | None, leaving: ChatMemory) -> tuple[Any, ...]:
    """The page for `saved` (or a new chat), instead of the chat whose memory is `leaving`. A reply
    still streaming there stops, and the new view is returned only once its stream has ended: the
    stream's updates are sent as it yields them, so each is then on its way before this view is. (On
    a loaded machine, an update yielded just before the switch otherwise arrived after the new chat's
    view, and the page showed the left chat in the new one.)"""
    leaving.left = True
    if leaving.turn is not None:
        leaving.turn.stop()
    return show(store, saved, leaving.user)


def rename(store: ChatStore, text: str, memory: ChatMemory) -> Any:
    with store.lock:
        saved = store.get(memory.session_id)
        if saved is not None:
            saved.title = text.strip()
            store.save(saved)
            memory.revision = saved.revision
    return chooser(store, memory.session_id)


def clear(store: ChatStore, uploads: Path, memory: ChatMemory) -> Any:
    """The shown chat emptied by the page's trash icon: an empty chat is not kept, so its file and
    the files the app wrote for it go, and the page goes on in it as a new chat."""
    forget(store, uploads, memory)
    memory.replies.clear()
    memory.revision = 0
    return chooser(store, memory.session_id)


def delete(store: ChatStore, uploads: Path, memory: ChatMemory) -> tuple[Any, ...]:
    """Delete the shown chat and its files, then show the most recent other chat."""
    forget(store, uploads, memory)
    memory.deleted = True  # a reply or voice turn still finishing does not save it again
    return switch(store, store.latest(), memory)


def forget(store: ChatStore, uploads: Path, memory: ChatMemory) -> None:
    """Delete the saved chat and the files the app wrote for it: its spoken replies and voice
    questions. Uploads stay: Gradio keeps one file per content, which other chats may show too."""
    saved = store.get(memory.session_id)
    for message in saved.history if saved else []:
        for block in blocks(message):
            path = Path(file_path(block) or "")
            if path.parent == uploads and path.name.startswith((REPLY_PREFIX, UTTERANCE_PREFIX)):
                path.unlink(missing_ok=True)
    store.delete(memory.session_id)


def chooser(store: ChatStore, selected: str) -> Any:
    """The list of chats, the most recently used first, `selected` checked if it is saved."""
    choices = [(plain(title), chat_id) for title, chat_id in store.titles()]
    return gr.update(choices=choices, value=selected if any(chat_id == selected for _, chat_id in choices) else None)


def matching(store: ChatStore, query: str) -> list[str] | None:
    """The ids of the chats whose title or messages hold every word of `query` (any case), the list's
    order kept; None for a blank query (the list shows every chat). Reads each chat: a search runs
    once a person pauses typing, not as chats are saved."""
    words = query.casefold().split()
    if not words:
        return None
    return [chat.id for chat in store.all() if all(word in _searched_text(chat) for word in words)]


def _searched_text(chat: SavedChat) -> str:
    texts = [plain(chat.shown_title)] + [text for message in chat.history for block in blocks(message)
                                         if (text := block_text(block)) is not None]
    return "\n".join(texts).casefold()


# Markdown a first question may hold, which the list shows as plain text: a link or picture
# becomes its text; emphasis, code and strike-through marks go; so do a line's heading, quote and
# list marks, and marks a title's cut left unpaired.
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_PAIRED = re.compile(r"(\*\*|__|~~|`+|\*|_)(?=\S)(.+?)(?<=\S)\1(?!\w)")
_LEADING = re.compile(r"^\s*(?:#{1,6}|>|[-+*]|\d+[.)])\s+")
_UNPAIRED = re.compile(r"\*\*|~~|`+")


def plain(title: str) -> str:
    """`title` as plain text: "**Why** is `x` 0?" is "Why is x 0?"."""
    text = _LEADING.sub("", _LINK.sub(r"\1", title))
    while (unwrapped := _PAIRED.sub(r"\2", text)) != text:
        text = unwrapped
    return " ".join(_UNPAIRED.sub("", text).split())
