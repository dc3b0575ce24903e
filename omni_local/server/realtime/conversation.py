"""A realtime session's conversation: its items, as the client sees them, and the messages the
model's prompt is built from them, which are one and the same record: what an item says (a reply
truncated to what was played included) is exactly what the next prompt holds, so the prefix cache,
which matches content, reuses every turn before the first change (cache on = cache off).

An assistant item that was spoken keeps a map from the audio sent to the transcript sent with it, so
that `conversation.item.truncate` at `audio_end_ms` cuts its text to what had been sent with the
last piece of audio that had begun playing by then. The Talker speaks the text as it comes, a little
behind it, so the text kept may run a few words ahead of the audio played, never behind it.
"""

import bisect
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from omni_local.protocol.events import SPEECH_SAMPLE_RATE
from omni_local.protocol.functions import ToolCall
from omni_local.protocol.messages import Message
from omni_local.server.realtime.client_events import EventError

Status = Literal["in_progress", "completed", "incomplete"]


@dataclass
class SpokenText:
    """Where a spoken reply's transcript stood as each piece of its audio was sent."""

    samples: list[int] = field(default_factory=list)  # 24 kHz samples sent, after each piece
    chars: list[int] = field(default_factory=list)  # characters of the transcript sent with each piece

    def sent(self, samples: int, chars: int) -> None:
        self.samples.append(self.total + samples)
        self.chars.append(chars)

    @property
    def total(self) -> int:
        return self.samples[-1] if self.samples else 0

    def chars_at(self, audio_end_ms: int) -> int:
        """The transcript's characters sent with the pieces of audio begun before `audio_end_ms`."""
        played = audio_end_ms * SPEECH_SAMPLE_RATE // 1000
        if played > self.total:
            raise EventError(f"audio_end_ms {audio_end_ms} is past the item's audio "
                             f"({self.total * 1000 // SPEECH_SAMPLE_RATE} ms)", param="audio_end_ms")
        begun = bisect.bisect_left(self.samples, played) + 1 if played else 0  # a piece begins where one ends
        return self.chars[min(begun, len(self.chars)) - 1] if begun else 0


@dataclass
class Item:
    """One conversation item: a message (user text and audio, or a reply), a function call, or its output."""

    id: str
    type: Literal["message", "function_call", "function_call_output"]
    role: Literal["user", "assistant", "tool"] = "user"  # "tool": a function call's output
    text: str = ""  # a message's text or transcript; a call's output
    audio: np.ndarray | None = None  # a user's speech: 16 kHz mono float32
    spoken: SpokenText | None = None  # an assistant message spoken
    call: ToolCall | None = None  # a function call; a function_call_output's call id is `call.id`
    call_id: str = ""  # a function_call_output: the call it answers
    response_id: str = ""  # the response that made an assistant item
    token_ids: list[int] | None = None  # a reply's tokens as the model made them, while its text is whole
    status: Status = "completed"

    def shape(self) -> dict:
        """The item as OpenAI's Realtime API writes it."""
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**base, "call_id": self.call.id, "name": self.call.name, "arguments": self.call.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.text}
        return {**base, "role": self.role, "content": self.content()}

    def content(self) -> list[dict]:
        if self.role == "assistant":
            if self.spoken is not None:
                return [{"type": "output_audio", "transcript": self.text}]
            return [{"type": "output_text", "text": self.text}]
        parts = [{"type": "input_audio", "transcript": None}] if self.audio is not None else []
        return parts + ([{"type": "input_text", "text": self.text}] if self.text else [])

    def truncate(self, audio_end_ms: int) -> None:
        if self.role != "assistant" or self.spoken is None:
            raise EventError(f"item {self.id} is not a spoken reply: only a reply's audio can be truncated",
                             param="item_id")
        self.text = self.text[:self.spoken.chars_at(audio_end_ms)]
        self.token_ids = None  # the prompt tokenizes the text kept


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def add(self, item: Item) -> str | None:
        """Add `item` at the end; the id of the item before it."""
        before = self.items[-1].id if self.items else None
        if any(known.id == item.id for known in self.items):
            raise EventError(f"the conversation already has an item {item.id}", param="item.id")
        self.items.append(item)
        return before

    def find(self, item_id: str) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise EventError(f"the conversation has no item {item_id}", "item_not_found", "item_id")

    def remove(self, item_id: str) -> None:
        self.items.remove(self.find(item_id))

    def messages(self, instructions: str) -> list[Message]:
        """The prompt's messages: `instructions` as the system turn, then the items in order, a
        response's calls on its reply's message."""
        messages = [Message("system", [instructions])] if instructions else []
        made_by = ""  # the response that made the last message, if a reply
        for item in self.items:
            if item.type == "function_call" and made_by == item.response_id and messages[-1].role == "assistant":
                messages[-1].tool_calls += (item.call,)
                messages[-1].token_ids = None  # the prompt writes the calls anew
                continue
            messages.append(_message(item))
            made_by = item.response_id
        return messages

    def last_asks(self) -> bool:
        """The conversation ends in what a response answers: a user's message or a call's output."""
        return bool(self.items) and self.items[-1].role in ("user", "tool")


def _message(item: Item) -> Message:
    if item.type == "function_call_output":
        return Message("tool", [item.text], tool_call_id=item.call_id)
    if item.type == "function_call":
        return Message("assistant", [""], tool_calls=(item.call,))
    if item.role == "assistant":
        return Message("assistant", [item.text], token_ids=item.token_ids)
    return Message("user", ([item.audio] if item.audio is not None else []) + ([item.text] if item.text else []))
