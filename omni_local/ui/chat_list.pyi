"""The sidebar's list of saved chats: Gradio's radio group (drawn by its own Radio, this being a
template of it), one chat a row, the shown chat checked; page_style.py draws it as a list.

Gradio writes a stub of each component class it is given (chat_list.pyi, kept beside it) when the
class is defined, which is why this class has a module of its own."""

from typing import Any

import gradio as gr

from gradio.events import Dependency

class ChatList(gr.Radio):
    """A choice is (shown title, chat id). Any id is taken, not only a listed one: a page or API
    client opened before a chat was saved has not been sent it, and an id of no saved chat opens a
    new one (Gradio's radio group refuses a value it has not listed)."""

    is_template = True

    def preprocess(self, payload: Any) -> str | None:
        return payload if isinstance(payload, str) else None
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component