"""A realtime session's configuration: what `session.update` set (and a `response.create` may set for
its one response), checked against what the server serves, and shown back in `session.created` /
`session.updated` as the effective whole."""

from dataclasses import dataclass, field, replace

from omni_local.errors import RequestError
from omni_local.protocol.backend import BackendInfo
from omni_local.protocol.functions import Tool
from omni_local.protocol.tools import FunctionChoice, ToolChoice, ToolUse
from omni_local.server.realtime.client_events import (EventError, FunctionTool, ResponseFields, ServerVad,
                                                      SessionFields)

PCM = {"type": "audio/pcm", "rate": 24000}


@dataclass(frozen=True)
class SessionConfig:
    model: str
    voice: str
    modality: str  # "audio" (with its transcript) or "text"
    instructions: str = ""
    turn_detection: ServerVad | None = field(default_factory=lambda: ServerVad(type="server_vad"))
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    max_output_tokens: int | None = None  # None: the server's max_new_tokens

    @classmethod
    def default(cls, info: BackendInfo, voice: str) -> "SessionConfig":
        return cls(info.model_id, voice, "audio" if info.speech else "text")

    def updated(self, fields: SessionFields | ResponseFields, info: BackendInfo) -> "SessionConfig":
        """This configuration with `fields` set; what the server cannot do is an `EventError`."""
        changes: dict = {}
        if fields.instructions is not None:
            changes["instructions"] = fields.instructions
        if fields.output_modalities is not None:
            changes["modality"] = fields.output_modalities[0]
            if changes["modality"] == "audio" and not info.speech:
                raise EventError("this server does not speak (its speech setting is off): ask for output_modalities "
                                 "['text']", param="output_modalities")
        if fields.tools is not None:
            changes["tools"] = tuple(_tool(tool, f"tools[{n}]") for n, tool in enumerate(fields.tools))
        if fields.tool_choice is not None:
            choice = fields.tool_choice
            changes["tool_choice"] = choice if isinstance(choice, str) else FunctionChoice(choice.name)
        if fields.max_output_tokens is not None:
            changes["max_output_tokens"] = None if fields.max_output_tokens == "inf" else fields.max_output_tokens
        if isinstance(fields, SessionFields) and fields.audio is not None:
            changes |= _audio_changes(fields, info)
        config = replace(self, **changes)
        config.tool_use()  # a choice naming no tool offered is refused now
        return config

    def tool_use(self) -> ToolUse | None:
        if not self.tools and self.tool_choice == "auto":
            return None
        try:
            return ToolUse(self.tools, self.tool_choice)
        except RequestError as error:
            raise EventError(str(error), param="tool_choice") from None

    def shape(self) -> dict:
        """As `session.created` and `session.updated` show it."""
        vad = None if self.turn_detection is None else self.turn_detection.model_dump()
        choice = self.tool_choice if isinstance(self.tool_choice, str) else {"type": "function",
                                                                             "name": self.tool_choice.name}
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                 for t in self.tools]
        return {"type": "realtime", "object": "realtime.session", "model": self.model,
                "instructions": self.instructions, "output_modalities": [self.modality],
                "audio": {"input": {"format": PCM, "turn_detection": vad},
                          "output": {"format": PCM, "voice": self.voice}},
                "tools": tools, "tool_choice": choice,
                "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens}


def _audio_changes(fields: SessionFields, info: BackendInfo) -> dict:
    changes: dict = {}
    audio = fields.audio
    if audio.input is not None and "turn_detection" in audio.input.model_fields_set:
        changes["turn_detection"] = audio.input.turn_detection
    voice = audio.output.voice if audio.output is not None else None
    if voice is not None:
        if info.voices and voice not in info.voices:
            raise EventError(f"the voice {voice!r} is not one of this model's: {', '.join(info.voices)}",
                             param="audio.output.voice")
        changes["voice"] = voice
    return changes


def _tool(tool: FunctionTool, at: str) -> Tool:
    try:
        if tool.parameters is None:
            return Tool(tool.name, tool.description)
        return Tool(tool.name, tool.description, tool.parameters)
    except RequestError as error:
        raise EventError(f"{at}: {error}", param=at) from None
