"""A conversation as every backend takes it: messages of text and decoded media, and the tool calls
and results of a conversation with tools (functions.py)."""

import inspect
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from PIL import Image

from omni_local.errors import RequestError
from omni_local.media.video import Video, VideoFile
from omni_local.protocol.functions import Tool, ToolCall

# "tool": a tool's result, answering an assistant message's call.
Role = Literal["system", "user", "assistant", "tool"]
# Text, an RGB image, 16 kHz mono float32 samples, a decoded video, or a video file sent as it is
# (to a remote backend, which decodes it there).
Part = str | Image.Image | np.ndarray | Video | VideoFile


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)
    # A reply's tokens as the model made them: the next prompt reuses them as they are, so the
    # reply's cached KV stays valid (decoding and re-tokenizing could give other ids).
    token_ids: list[int] | None = None
    reasoning: str = ""  # a Thinking checkpoint's reply: what it reasoned before its answer (`parts`)
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls, after its text
    tool_call_id: str | None = None  # a tool message: the id of the call whose result it is
    # A system message: the tools the prompt offers (the chat template lists them in the system turn).
    tools: tuple[Tool, ...] = ()

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    def images(self) -> list[Image.Image]:
        return [p for p in self.parts if isinstance(p, Image.Image)]

    def audios(self) -> list[np.ndarray]:
        return [p for p in self.parts if isinstance(p, np.ndarray)]

    def videos(self) -> list[Video]:
        return [p for p in self.parts if isinstance(p, Video)]


def reply_key(text: str, reasoning: str = "") -> str:
    """A reply's text (and reasoning) as a client gives it back, to look up the token ids the model
    made it of (and so its cached KV, which text tokenized anew could miss). Gradio's chatbot cleans
    each text as a docstring (`inspect.cleandoc`: tabs expanded, indentation and the ends' blank
    lines removed); an API client may do the same, or trim the ends. Two replies with one answer
    but different reasoning are different replies; a reasoning of white space alone is none."""
    answer, reasoning = _cleaned(text), _cleaned(reasoning)
    return f"{reasoning}\0{answer}" if reasoning else answer


def _cleaned(text: str) -> str:
    """`text` cleaned as a docstring and trimmed, again until that changes nothing: a text cleaned
    once can change when cleaned again (a blank first line leaves the next line's indentation in
    the margin), and the page sends back the text Gradio cleaned."""
    while (cleaned := inspect.cleandoc(text).strip()) != text:
        text = cleaned
    return text
