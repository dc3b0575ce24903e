"""A chat completion request as OpenAI's clients send it, the fields this server reads.

Fields it does not know are ignored: clients send many (`user`, `logprobs`, `tools`, ...). Values are
checked strictly, as OpenAI checks them: "0.5" is not a number and true is not an integer.
Besides OpenAI's fields, omni_local's own sampling knobs `top_k` and `repetition_penalty`, and the
Talker's `talker_temperature` for a spoken reply (0 is greedy).
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Fields):
    type: Literal["text"]
    text: str


class Url(_Fields):
    url: str


class ImagePart(_Fields):
    type: Literal["image_url"]
    image_url: Url


class VideoPart(_Fields):
    type: Literal["video_url"]
    video_url: Url


class AudioData(_Fields):
    data: str  # base64 of the file
    format: Literal["wav", "mp3"] = "wav"  # what the client says it is; the bytes decide


class AudioPart(_Fields):
    type: Literal["input_audio"]
    input_audio: AudioData


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Fields):
    # "developer" is OpenAI's newer name for the system message.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Fields):
    include_usage: bool = False


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
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins over it
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    talker_temperature: float | None = None  # None: the Talker's default

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

    def sampling(self) -> dict[str, object]:
        """The sampling values the request sets, by the names `OmniLocal.sampling` takes."""
        longest = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        given = {
            "max_new_tokens": longest, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
        }
        return {name: value for name, value in given.items() if value is not None}
