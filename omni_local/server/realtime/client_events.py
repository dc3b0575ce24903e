"""The client's events, as OpenAI's Realtime API (GA) defines them, read and checked: a message that
is not one of them, or asks for what this server does not do, is an `EventError`, which the session
answers with an `error` event and goes on.

Fields this server does not act on (transcription of the input, noise reduction, tracing, a
response's metadata) are read past; values that would change what is asked for are refused: an audio
format other than PCM16 at 24 kHz, semantic VAD, a response outside the conversation.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from omni_local.server.errors import place


class EventError(Exception):
    """A client event refused: its message, OpenAI's code, the field at fault, the event's own id."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.event_id = message, code, param, event_id


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AudioFormat(_Fields):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class ServerVad(_Fields):
    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    silence_duration_ms: int = Field(500, ge=32, le=10_000)  # at least one VAD step (32 ms)
    prefix_padding_ms: int = Field(300, ge=0, le=5_000)
    create_response: bool = True
    interrupt_response: bool = True


class AudioInput(_Fields):
    format: AudioFormat | None = None
    turn_detection: ServerVad | None = Field(default=None)


class AudioOutput(_Fields):
    format: AudioFormat | None = None
    voice: str | None = None


class Audio(_Fields):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class FunctionTool(_Fields):
    type: Literal["function"] = "function"
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


class FunctionChoice(_Fields):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | FunctionChoice
Modalities = list[Literal["text", "audio"]]
MaxTokens = Annotated[int, Field(ge=1)] | Literal["inf"]


class SessionFields(_Fields):
    type: Literal["realtime"] = "realtime"
    instructions: str | None = None
    output_modalities: Modalities | None = Field(None, min_length=1, max_length=1)
    audio: Audio | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    max_output_tokens: MaxTokens | None = None


class ContentPart(_Fields):
    type: Literal["input_text", "input_audio", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = None  # input_audio: base64 PCM16 at 24 kHz
    transcript: str | None = None


class MessageItem(_Fields):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant"]
    content: list[ContentPart] = Field(min_length=1)


class FunctionCallOutputItem(_Fields):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str


Item = Annotated[MessageItem | FunctionCallOutputItem, Field(discriminator="type")]


class ResponseFields(_Fields):
    conversation: Literal["auto"] = "auto"
    instructions: str | None = None
    output_modalities: Modalities | None = Field(None, min_length=1, max_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    max_output_tokens: MaxTokens | None = None


class _Event(_Fields):
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionFields


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: str | None = None


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseFields | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = (SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemTruncate | ItemDelete
               | ResponseCreate | ResponseCancel)
_EVENTS = {model.model_fields["type"].annotation.__args__[0]: model for model in ClientEvent.__args__}
_ITEM_TYPES = {"message", "function_call_output"}
_READER = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])


def read_event(text: str | bytes) -> ClientEvent:
    """One client message as its event; an `EventError` says what is wrong with it."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EventError("a client event must be a JSON object", "invalid_json") from None
    if not isinstance(raw, dict):
        raise EventError("a client event must be a JSON object", "invalid_json")
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    if kind not in _EVENTS:
        raise EventError(f"this server does not know the event type {kind!r}; it knows {', '.join(_EVENTS)}",
                         "unknown_event_type", "type", event_id)
    try:
        return _READER.validate_python(raw)
    except ValidationError as error:
        first = error.errors()[0]
        # Past the event's type, which pydantic names first, and an item's, which it names after "item".
        where = place(tuple(step for step in first["loc"][1:] if step not in _ITEM_TYPES))
        raise EventError(f"{kind}: {where}: {first['msg']}", "invalid_value", where, event_id) from None
