"""Files ChatInterface would lose: an edited question's, and those put in the box while a reply streams.

Gradio's edit (the pencil on a question) gives the new text alone, and the page has already put that
text in place of the whole question, its files gone: ChatInterface would then show and ask the
question without the pictures, clips or videos it was asked with. Here the edited question is the
message box's kind of message, the files of the question as it was and its new text, so it is shown,
asked and saved whole.

ChatInterface empties the message box when a question is sent and turns it off while the reply
streams; its box still takes a file dropped on it then, and shows it. When the reply ends, Gradio
turns the box on again and empties it once more, and the file dropped meanwhile (such as the one
just sent, dropped again at once) is gone. Here the box is only turned on again.
"""

from typing import Any

import gradio as gr
from gradio.block_function import BlockFunction
from gradio.context import get_blocks_context

from omni_local.ui.messages import blocks, file_path


class ChatInterface(gr.ChatInterface):
    """Gradio's ChatInterface (multimodal), whose edited questions keep their files, and whose
    message box keeps a file put in it while a reply streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Its events are the page's when it is made inside one (as the app's is), its own if not.
        events = (get_blocks_context() or self).fns
        # Gradio (pinned in pyproject.toml) gives its edit the page's chat alone: it is given
        # ChatInterface's own copy too, the chat as it was before the edit.
        edit = next(event for event in events.values() if event.fn == self._edit_message)
        edit.inputs.append(self.chatbot_state)
        for event in self._box_turned_on_after_replies(events):
            event.fn = _turn_on

    def _box_turned_on_after_replies(self, events: dict[int, BlockFunction]) -> list[BlockFunction]:
        """The events that turn the message box on again once a reply has ended (after a send, a
        retry, an edit): each follows the reply's copy into ChatInterface's state, and writes the box alone."""
        copies = {number for number, event in events.items()
                  if event.outputs == [self.chatbot_state, self.chatbot_value]}
        return [event for event in events.values() if event.trigger_after in copies and event.outputs == [self.textbox]]

    def _edit_message(self, history: list[dict[str, Any]], edit_data: gr.EditData,
                      before: list[dict[str, Any]] | None = None) -> tuple[Any, Any, Any]:
        kept, state, text = super()._edit_message(history, edit_data)  # the chat before the question
        asked = (before or [])[len(kept):len(kept) + 1]
        return kept, state, edited_question(asked[0] if asked else {}, text)


def edited_question(asked: dict[str, Any], text: str) -> dict[str, Any]:
    """The question `asked` (in either form the chat holds it) with `text` in place of its text."""
    files = [path for block in blocks(asked) if (path := file_path(block))] if asked.get("role") == "user" else []
    return {"text": text, "files": files}


def _turn_on() -> dict[str, Any]:
    """Gradio's update after a reply less its emptying: the box was emptied when the question was sent."""
    return gr.update(interactive=True)
