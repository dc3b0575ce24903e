"""A question edited in the page keeps its files.

Gradio's edit (the pencil on a question) gives the new text alone, and the page has already put that
text in place of the whole question, its files gone: ChatInterface would then show and ask the
question without the pictures, clips or videos it was asked with. Here the edited question is the
message box's kind of message, the files of the question as it was and its new text, so it is shown,
asked and saved whole.
"""

from typing import Any

import gradio as gr
from gradio.context import get_blocks_context

from omni_local.ui.messages import blocks, file_path


class ChatInterface(gr.ChatInterface):
    """Gradio's ChatInterface (multimodal), whose edited questions keep their files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Gradio (pinned in pyproject.toml) gives its edit the page's chat alone: it is given
        # ChatInterface's own copy too, the chat as it was before the edit.
        # Its events are the page's when it is made inside one (as the app's is), its own if not.
        events = (get_blocks_context() or self).fns.values()
        edit = next(event for event in events if event.fn == self._edit_message)
        edit.inputs.append(self.chatbot_state)

    def _edit_message(self, history: list[dict[str, Any]], edit_data: gr.EditData,
                      before: list[dict[str, Any]] | None = None) -> tuple[Any, Any, Any]:
        kept, state, text = super()._edit_message(history, edit_data)  # the chat before the question
        asked = (before or [])[len(kept):len(kept) + 1]
        return kept, state, edited_question(asked[0] if asked else {}, text)


def edited_question(asked: dict[str, Any], text: str) -> dict[str, Any]:
    """The question `asked` (in either form the chat holds it) with `text` in place of its text."""
    files = [path for block in blocks(asked) if (path := file_path(block))] if asked.get("role") == "user" else []
    return {"text": text, "files": files}
