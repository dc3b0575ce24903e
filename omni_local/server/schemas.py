"""A chat completion request as OpenAI's clients send it: every field of OpenAI's chat completions
request (the `openai` package's `completion_create_params`) is read, accepted as harmless, or refused.

Nothing is silently ignored. A field this server does not know is refused with 400 naming it, as
OpenAI refuses one. Of OpenAI's fields, those declared here without a comment are read; those
commented "ignored" leave the reply as it is by their definition (an id for OpenAI's abuse checks, a
hint to its cache or its billing), so they are accepted and dropped; the rest are refused with 400
naming the field (`ChatRequest.unsupported`) when set to a value that asks for what this server does
not do: the older function calls, JSON replies, token penalties and biases, reasoning effort,
verbosity, web search, moderation, stored completions, more than one reply. Their values that ask
for nothing (`function_call: "none"`, a penalty of 0, `response_format: {"type": "text"}`) are
accepted, as clients send them by default.

Tools are OpenAI's function tools (`tools`, `tool_choice`, `parallel_tool_calls`; an assistant
message's `tool_calls` and `tool` messages with their `tool_call_id`): protocol/tools.py says what
each choice does.

Values are checked strictly, as OpenAI checks them: "0.5" is not a number and true is not an integer.
Besides OpenAI's fields, omni_local's own sampling knobs `top_k` and `repetition_penalty`, the
Talker's `talker_temperature` for a spoken reply (0 is greedy), and `max_reasoning_tokens` for a
Thinking checkpoint. An assistant message may carry its reasoning as `reasoning_content` (vLLM's and
DeepSeek's name, which this server's replies use too).
"""

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_local.protocol.params import MAX_TOP_LOGPROBS

FUNCTIONS = "the older function calls are not supported: send tools and tool_choice instead"
# (field, whether the request asks for what this server does not do, why it is refused)
Ask = tuple[str, bool, str]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Part(_Fields):
    prompt_cache_breakpoint: dict[str, Any] | None = None  # ignored: a hint to OpenAI's cache; ours matches content


class TextPart(_Part):
    type: Literal["text"]
    text: str


class Url(_Fields):
    url: str
    # ignored: OpenAI's choice of resolution and cost; the model here sees each image as its processor
    # sizes it (within max_image_pixels)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: Url


class VideoPart(_Fields):
    type: Literal["video_url"]
    video_url: Url


class AudioData(_Fields):
    data: str  # base64 of the file
    format: Literal["wav", "mp3"] = "wav"  # what the client says it is; the bytes decide


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: AudioData


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class CalledFunction(_Fields):
    name: str
    arguments: str  # JSON text of an object


class MessageToolCall(_Fields):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Fields):
    # "developer" is OpenAI's newer name for the system message.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None  # an assistant message's reasoning
    name: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None  # an earlier spoken reply, by its id
    tool_calls: list[MessageToolCall] | None = None  # an assistant message's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    function_call: dict[str, Any] | None = None

    def asks(self, at: str) -> list[Ask]:
        return [
            (f"{at}.name", self.name is not None,
             "the chat template has no place for a participant's name: put it in the content"),
            (f"{at}.refusal", self.refusal is not None, "send the earlier refusal as the message's content"),
            (f"{at}.audio", self.audio is not None,
             "this server keeps no audio between requests: send the earlier reply's transcript as its content"),
            (f"{at}.function_call", self.function_call is not None, FUNCTIONS),
        ]


class Function(_Fields):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # ignored: OpenAI's schema-constrained decoding; the call is checked as JSON alone


class FunctionTool(_Fields):
    type: Literal["function"]
    function: Function


class ChosenFunction(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(_Fields):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: padding OpenAI adds to chunks against a side channel


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class AudioOptions(_Fields):
    voice: str | None = None  # None: the `voice` setting
    format: Literal["wav", "pcm16"] | None = None  # None: pcm16 when streamed, else wav


class ChatRequest(_Fields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins over it
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # ignored: ids of the person asking, for OpenAI's abuse checks; the reply does not depend on them
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None  # ignored: tags of a stored completion, and none is stored (`store`)
    # read: which requests share a cache, within the key's holder's (access.py `within`)
    prompt_cache_key: str | None = None
    # ignored: hints to OpenAI's prompt cache (for how long, how); ours matches content
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None  # ignored: OpenAI's price and speed tier; this server has one
    prediction: dict[str, Any] | None = None  # ignored: a guess at the reply, to speed OpenAI up; the same reply
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None  # None: "auto"
    parallel_tool_calls: bool | None = None  # None: true
    # Refused when they ask for something (`unsupported`):
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    store: bool | None = None
    # omni_local's own:
    top_k: int | None = None
    repetition_penalty: float | None = None
    talker_temperature: float | None = None  # None: the Talker's default
    max_reasoning_tokens: int | None = None  # None: the setting's

    @property
    def speaks(self) -> bool:
        return "audio" in (self.modalities or [])

    @property
    def audio_format(self) -> str:
        given = self.audio.format if self.audio is not None else None
        return given or ("pcm16" if self.stream else "wav")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def unsupported(self) -> tuple[str, str] | None:
        """The first field that asks for what this server does not do, and why; None: none does."""
        return next(((name, why) for name, asks, why in self._asks() if asks), None)

    def _asks(self) -> Iterator[Ask]:
        penalties = "OpenAI's token penalties are not supported: repetition_penalty is this server's"
        yield from [
            ("n", self.n not in (None, 1), "n must be 1: this server makes one reply per request"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs, "top_logprobs needs logprobs: true"),
            ("functions", bool(self.functions), FUNCTIONS),
            ("function_call", self.function_call not in (None, "none", "auto"), FUNCTIONS),
            ("response_format", self.response_format is not None and self.response_format.type != "text",
             "JSON replies (json_object, json_schema) are not supported: only text"),
            ("frequency_penalty", self.frequency_penalty not in (None, 0), penalties),
            ("presence_penalty", self.presence_penalty not in (None, 0), penalties),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("reasoning_effort", self.reasoning_effort is not None,
             "reasoning_effort is not supported: max_reasoning_tokens limits a Thinking checkpoint's reasoning"),
            ("verbosity", self.verbosity is not None, "verbosity is not supported"),
            ("web_search_options", self.web_search_options is not None, "this server does not search the web"),
            ("moderation", self.moderation is not None, "this server runs no moderation"),
            ("store", bool(self.store), "this server stores no completions"),
        ]
        for index, message in enumerate(self.messages):
            yield from message.asks(f"messages[{index}]")

    def sampling(self) -> dict[str, object]:
        """The sampling values the request sets, by the names `OmniLocal.sampling` takes."""
        longest = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        given = {
            "max_new_tokens": longest, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "max_reasoning_tokens": self.max_reasoning_tokens,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
        }
        return {name: value for name, value in given.items() if value is not None}
