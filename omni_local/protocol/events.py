"""What a reply streams back, from any backend: text, audio, tool calls, and one final `Finished`.

A request that offers tools (protocol/tools.py) gets each call the model makes as a `ToolCall`, once
its text is whole; the answer's `TextDelta`s are then the text outside the calls.

A Thinking checkpoint reasons before it answers: its reasoning streams as `ReasoningDelta`s, apart
from the answer's `TextDelta`s, so a caller that shows only answers ignores them.

A request that asks for log-probabilities (`SamplingParams.logprobs`) gets them on its `TextDelta`s:
each delta carries those of the answer's tokens whose text it completes (a token that ends inside a
character waits for the delta that completes it). They are the model's: the log-softmax of its
logits over the tokens a reply may hold, before the repetition penalty, the temperature, top-k and
top-p, as OpenAI reports them; a sampled token is drawn from the distribution those shape.

A request the engine cannot start at once (every seat taken, or too few KV blocks free) waits in line
in the order it came: it is told its place as `Waiting` events, one when it begins to wait and one
each time its place changes, and none once it starts (nor any for a request started at once). A
remote backend reports none: OpenAI's stream has no such field.

Figures a backend does not report are None (a remote server may not say how long a request
queued, or which of its cached tokens came from host memory): shown as unknown, never as zeros.
"""

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from omni_local.protocol.functions import ToolCall

SPEECH_SAMPLE_RATE = 24_000  # Code2Wav's output: spoken replies, at every backend
StopReason = Literal["end_of_turn", "max_new_tokens", "context_full", "cancelled"]


@dataclass(frozen=True)
class TokenChoice:
    """A token and its log-probability, as OpenAI's `top_logprobs` entries give them."""

    token: str  # its text; one that is part of a character: its bytes, written "bytes:\\xe4\\xbd" as OpenAI's are
    logprob: float
    utf8: bytes | None  # its bytes, OpenAI's `bytes` (None: the tokenizer has no token of this id)


@dataclass(frozen=True)
class TokenLogprob(TokenChoice):
    """A reply token's log-probability, and the likeliest tokens in its place, best first."""

    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens this text completes, if the request asked


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class Waiting:
    """The request waits for the engine to start it. `ahead`: the replies before it, those ahead of it
    in line and the running one whose seat (or blocks) the first in line waits for: the first in
    line is told 1, the next 2."""

    ahead: int


@dataclass(frozen=True)
class AudioChunk:
    """The next piece of a spoken reply: mono float32 samples in [-1, 1], and the codec frames
    (`num_code_groups` codes each, 80 ms of audio) this chunk completed (none from a remote backend)."""

    samples: np.ndarray
    frames: list[list[int]] = field(default_factory=list)
    sample_rate: int = SPEECH_SAMPLE_RATE


@dataclass(frozen=True)
class TokenCounts:
    prompt: int | None  # tokens in the prompt
    computed: int | None  # prompt tokens the Thinker computed; the rest came from the prefix cache:
    reused_gpu: int | None  # ... from KV on the device (a remote server's count of both, if it does not split them)
    reused_host: int | None  # ... from KV brought back from host memory
    generated: int | None  # reply tokens

    @property
    def reused(self) -> int | None:
        if self.reused_gpu is None:
            return None
        return self.reused_gpu + (self.reused_host or 0)


@dataclass(frozen=True)
class Timings:
    queue_wait_s: float | None  # submit until the engine took the request, less building its prompt
    ttft_s: float | None  # submit until the first reply token
    decode_tokens_per_s: float | None  # reply tokens after the first, per second; 0 for a reply of one token


@dataclass(frozen=True)
class ContextUse:
    """How much a request may hold, for a caller to show a turn's use of it ("702 of 8,192 tokens")."""

    size: int | None  # tokens of prompt and reply together a request may hold (max_context_tokens)
    prompt_limit: int | None  # the longest prompt (max_prompt_tokens)
    turns_left_out: int = 0  # the chat's earliest turns, left out of the prompt to fit prompt_limit


@dataclass(frozen=True)
class MediaCounts:
    """Where a prompt's images, clips and videos came from."""

    in_kv: int = 0  # inside the prefix the KV cache supplied: nothing to encode
    from_cache: int = 0  # encoder outputs from the encoder cache
    encoded: int = 0  # run through the encoders


@dataclass(frozen=True)
class SpeechReport:
    voice: str
    frames: int | None  # codec frames, 80 ms of audio each
    audio_s: float
    first_audio_s: float | None  # submit until the first audio chunk
    real_time_factor: float | None  # submit until the last chunk, over the audio's duration
    talker_prompt: int | None = None  # rows of the Talker's prompt
    talker_reused: int | None = None  # ... whose KV came from the session's earlier spoken turn


@dataclass(frozen=True)
class Finished:
    text: str  # the answer
    token_ids: list[int] | None  # the reply's tokens as the model made them, reasoning too (None: not reported)
    stop_reason: StopReason
    tokens: TokenCounts
    timings: Timings
    seed: int | None
    context: ContextUse
    speech: SpeechReport | None = None  # for a spoken reply
    media: MediaCounts | None = MediaCounts()  # None: not reported
    reasoning: str = ""  # what a Thinking checkpoint reasoned before its answer
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the reply made (`text` is what it said outside them)

    @property
    def context_used(self) -> int | None:
        """Tokens of the context this turn filled (its prompt and reply), of `context.size`."""
        if self.tokens.prompt is None or self.tokens.generated is None:
            return None
        return self.tokens.prompt + self.tokens.generated


Event = Waiting | TextDelta | ReasoningDelta | AudioChunk | ToolCall | Finished
