"""How a request lets the model use its tools (functions.py): which it offers, whether a call is
required, and what the request's `tool_choice` makes of the prompt.

Qwen3-Omni's chat template offers tools in its system turn, as JSON schemas, and the model calls one
as a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`
(tool_calls.py reads them). A tool's result comes back as a `tool` message, which the template puts
in a user turn between `<tool_response>` and `</tool_response>`.

`tool_choice`: "auto" offers the tools and the model decides; "none" offers none (the prompt is the
template's without tools, as vLLM builds it) and reads no call from the reply; "required" and a
named function offer them and begin the reply with the opening of a call (`REQUIRED_PREFIX`, or
the named function's `named_prefix`), which the model continues: the reply then is a call, unless
the model breaks the JSON (then it is returned as text, as any malformed call is).

A spoken reply that may call tools is spoken up to where its first call opens, and no further: the
call's text is never spoken, a malformed one included (it comes back as text, unspoken). A reply
begun with a call ("required", a named function) has no audio.
"""

import reprlib
from dataclasses import dataclass, replace
from typing import Literal

from omni_local.errors import RequestError
from omni_local.protocol.functions import Tool
from omni_local.protocol.kinds import ModelKind
from omni_local.protocol.messages import Message

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
REQUIRED_PREFIX = f'{CALL_OPEN}\n{{"name": "'


def named_prefix(name: str) -> str:
    """The opening of a call of `name`, up to its arguments."""
    return f'{REQUIRED_PREFIX}{name}", "arguments": '


@dataclass(frozen=True)
class FunctionChoice:
    """A `tool_choice` that names the function the reply must call."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | FunctionChoice


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers, how the reply may use them, and whether it may make more than
    one call (`parallel`: else the first call alone is kept)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        names = [tool.name for tool in self.tools]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise RequestError(f"tools: two tools are named {twice}")
        if self.choice not in ("auto", "none", "required") and not isinstance(self.choice, FunctionChoice):
            raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or a function, not "
                               f"{reprlib.repr(self.choice)}")
        if self.choice not in ("auto", "none") and not self.tools:
            raise RequestError("tool_choice: a call is required, but no tools are given")
        if isinstance(self.choice, FunctionChoice) and self.choice.name not in names:
            raise RequestError(f"tool_choice: no tool is named {reprlib.repr(self.choice.name)}")

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the prompt offers: none for "none"."""
        return () if self.choice == "none" else self.tools

    @property
    def reply_prefix(self) -> str:
        """How the reply begins, for "required" and a named function; else it begins freely ("")."""
        if isinstance(self.choice, FunctionChoice):
            return named_prefix(self.choice.name)
        return REQUIRED_PREFIX if self.choice == "required" else ""

    def known(self, name: str) -> bool:
        return any(tool.name == name for tool in self.offered)

    def check(self, kind: ModelKind) -> None:
        """Refuse what a model of `kind` cannot do with these tools."""
        if not self.offered:
            return
        if kind == "captioner":
            raise RequestError("tools: the Captioner describes audio and calls no tools")
        if kind == "thinking" and self.reply_prefix:
            raise RequestError("tool_choice: a Thinking checkpoint reasons before it answers, so its reply "
                               "cannot begin with a call: use 'auto'")

    def conversation(self, messages: list[Message]) -> list[Message]:
        """`messages` as the prompt is built from them: the offered tools on the system message (a
        new one if there is none), and the reply begun with `reply_prefix`."""
        if self.offered:
            if messages[0].role == "system":
                messages = [replace(messages[0], tools=self.offered), *messages[1:]]
            else:
                messages = [Message("system", tools=self.offered), *messages]
        return [*messages, Message("assistant", [self.reply_prefix])] if self.reply_prefix else messages
