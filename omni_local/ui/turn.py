"""A typed turn of the page's chat: its reply streaming into a chat, and how it is stopped, by the
stop button (chat.py) or by leaving its chat (sidebar.py)."""

import threading
from dataclasses import dataclass, field
from typing import Any

from omni_local.api import Reply
from omni_local.ui.chats import ChatStore

# The longest a stop waits for the stopped reply's last event (the stream's end, its chat saved).
STOP_WAIT_S = 30.0


@dataclass
class Turn:
    """A typed turn: the chat it was asked in (up to and with its question), where that chat is
    saved, and, once it ended, the chat as shown and saved."""

    reply: Reply
    store: ChatStore
    asked: list[dict[str, Any]]
    system_prompt: str
    ended: threading.Event = field(default_factory=threading.Event)
    shown: list[dict[str, Any]] | None = None
    context: str = ""  # the context use once it ended
    stopped: bool = False  # it ended cancelled, and the stop button has yet to show it so

    def stop(self) -> None:
        """Cancel the reply (unless it has ended on its own) and wait, up to STOP_WAIT_S, for its stream
        to end: the stream's last updates are then on their way before what the caller shows next."""
        if not self.reply.done:
            self.reply.cancel()
        self.ended.wait(STOP_WAIT_S)
