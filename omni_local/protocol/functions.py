"""The functions a request offers the model (OpenAI's function tools) and the calls a reply makes of
them: plain data, checked as it is made; tools.py says how a request uses them."""

import json
import reprlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from omni_local.errors import RequestError
from omni_local.protocol.text import check_text


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        check_text(self.name, "a tool's name")
        if not self.name or any(c.isspace() or c in "\"\\<>" for c in self.name):
            raise RequestError(f"a tool's name must be a word without spaces, quotes or angle brackets, "
                               f"not {reprlib.repr(self.name)}")
        check_text(self.description, f"tool {self.name}'s description")
        if not isinstance(self.parameters, dict):
            raise RequestError(f"tool {self.name}'s parameters must be a JSON schema object")

    def for_template(self) -> dict[str, Any]:
        """As the chat template lists it: OpenAI's tool object."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: its id (for the tool message that answers it), the function's name,
    and its arguments as JSON text, as OpenAI gives them."""

    id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        for value, what in [(self.id, "a tool call's id"), (self.name, "a tool call's name"),
                            (self.arguments, "a tool call's arguments")]:
            check_text(value, what)
        if not self.id or not self.name:
            raise RequestError("a tool call needs an id and a function name")
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise RequestError(f"tool call {self.id}'s arguments must be a JSON object, not "
                               f"{reprlib.repr(self.arguments)}")

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's chat API writes it in a message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
