"""The seam between the API and what answers: the engine in this process (`backends/local.py`), or
a server that speaks OpenAI's chat API (`backends/remote/`). Sessions, the chat page, voice mode
and the CLI see only this interface, so none of them imports the engine (nor torch) on a remote
backend."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omni_local.access import LOCAL_USER
from omni_local.media.video import Video
from omni_local.protocol.events import Event
from omni_local.protocol.kinds import ModelKind, kind_title
from omni_local.protocol.messages import Message, Part
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.protocol.tools import ToolUse


@dataclass(frozen=True)
class BackendInfo:
    """What a backend serves and what it allows, for the page's header, sliders and queue."""

    model_id: str  # the model's id, as an API names it ("demo", or the checkpoint folder's name)
    model: str  # the model's name, as the page's header shows it
    runs_on: str  # where it runs: "bfloat16 on cuda:0" (", int4", ", deterministic"), or the server's address
    speech: bool  # it can speak its replies
    voices: list[str]  # the voices it speaks in (may be empty where a remote server does not list them)
    max_context_tokens: int  # prompt plus reply, per request
    max_prompt_tokens: int  # the longest prompt it takes
    concurrency: int  # replies it makes at once: the page lets this many chats stream together
    video: bool  # it takes videos
    kind: ModelKind = "instruct"  # which member of the Qwen3-Omni family it is

    def describe(self) -> str:
        """What is served, where, and whether it speaks: the start-up line's and the page header's."""
        speech = "speech on" if self.speech else "speech off"
        return f"{kind_title(self.kind)} · {self.model} · {self.runs_on} · {speech}"


class ReplyStream(Protocol):
    """One reply as a backend makes it."""

    def events(self) -> Iterator[Event]:
        """Text and audio as they come, then one `Finished`; a failure raises `OmniLocalError`."""
        ...

    def cancel(self) -> None:
        """Stop the reply soon (from any thread): it ends with stop reason "cancelled"."""
        ...


class Backend(Protocol):
    info: BackendInfo

    def send(self, session: str, messages: list[Message], params: SamplingParams,
             speech: SpeechParams | None, principal: str = LOCAL_USER, tools: ToolUse | None = None) -> ReplyStream:
        """Queue a reply to `messages` (ending in a user turn, or a tool's result) of chat `session`,
        spoken too if `speech` is given, for `principal` (access.py), with whom alone its caches are
        shared; offering `tools`, whose calls then come as `ToolCall` events. A request this backend
        cannot serve (an unknown voice, say) raises here."""
        ...

    def read_video(self, item: str | Path | bytes | Video) -> Part:
        """A video as this backend takes it: decoded here for the local engine, checked and sent as
        its file to a remote one. Bad input raises `MediaError`."""
        ...

    def close(self) -> None:
        ...
