"""A request's state as it passes through the engine, and the events it streams back."""

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from omni_local.cache.prefix_cache import Claim
from omni_local.engine.detokenizer import IncrementalDetokenizer
from omni_local.engine.sampling import SamplingParams
from omni_local.engine.speech import SpeechParams, SpeechReport, SpokenReply
from omni_local.engine.thinker import MediaCounts, PreparedPrompt
from omni_local.engine.vocoder import SAMPLE_RATE
from omni_local.prompts import Message, Prompt

StopReason = Literal["end_of_turn", "max_new_tokens", "context_full", "cancelled"]

# The metrics line: a reply that ended on its own says nothing of it; the other ends are news to the person.
_STOP_WORDS = {"max_new_tokens": "reply length limit reached", "context_full": "context full", "cancelled": "stopped"}
_NOTICEABLE_WAIT_S = 0.1  # a shorter wait for the engine is lost in the TTFT, which includes it


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class AudioChunk:
    """The next piece of a spoken reply: mono float32 samples in [-1, 1], and the codec frames
    (`num_code_groups` codes each, 80 ms of audio) this chunk completed."""

    samples: np.ndarray
    frames: list[list[int]]
    sample_rate: int = SAMPLE_RATE


@dataclass(frozen=True)
class TokenCounts:
    prompt: int  # tokens in the prompt
    computed: int  # prompt tokens the Thinker computed; the rest came from the prefix cache:
    reused_gpu: int  # ... from KV on the device
    reused_host: int  # ... from KV brought back from host memory
    generated: int  # reply tokens


@dataclass(frozen=True)
class Timings:
    queue_wait_s: float  # submit until the engine took the request
    ttft_s: float  # submit until the first reply token
    decode_tokens_per_s: float  # reply tokens after the first, per second


@dataclass(frozen=True)
class ContextUse:
    """How much a request may hold, for a caller to show a turn's use of it ("702 of 8,192 tokens")."""

    size: int  # tokens of prompt and reply together a request may hold (max_context_tokens)
    prompt_limit: int  # the longest prompt (max_prompt_tokens)
    turns_left_out: int = 0  # the chat's earliest turns, left out of the prompt to fit prompt_limit


@dataclass(frozen=True)
class Finished:
    text: str
    token_ids: list[int]
    stop_reason: StopReason
    tokens: TokenCounts
    timings: Timings
    seed: int
    context: ContextUse
    speech: SpeechReport | None = None  # for a spoken reply
    media: MediaCounts = MediaCounts()

    @property
    def context_used(self) -> int:
        """Tokens of the context this turn filled (its prompt and reply), of `context.size`."""
        return self.tokens.prompt + self.tokens.generated

    def metrics_line(self) -> str:
        """One line for people (the CLI and the UI show it): how fast, what the caches supplied, what
        the prompt left out, and why the reply ended where that is news."""
        parts = (_speed(self.timings), _reuse(self.tokens), _counted(self.tokens.generated, "reply token"),
                 _media(self.media), _speech(self.speech), _left_out(self.context),
                 _STOP_WORDS.get(self.stop_reason, ""))
        return " · ".join(part for part in parts if part)


# The metrics line's parts: each is "" where it has nothing to say.


def _speed(t: Timings) -> str:
    queued = f" (queued {_duration(t.queue_wait_s)})" if t.queue_wait_s >= _NOTICEABLE_WAIT_S else ""
    rate = f" · {_figure(t.decode_tokens_per_s)} tok/s" if t.decode_tokens_per_s else ""
    return f"TTFT {_duration(t.ttft_s)}{queued}{rate}"


def _reuse(n: TokenCounts) -> str:
    host = f" ({n.reused_host:,} from host memory)" if n.reused_host else ""
    return f"{n.reused_gpu + n.reused_host:,} of {n.prompt:,} prompt tokens from cache{host}"


def _media(m: MediaCounts) -> str:
    if not (m.in_kv or m.from_cache or m.encoded):
        return ""
    return f"media: {m.encoded} encoded, {m.from_cache} from the encoder cache, {m.in_kv} in the cached prompt"


def _speech(s: SpeechReport | None) -> str:
    if s is None:
        return ""
    return (f"{s.audio_s:.1f} s of speech ({s.voice}), first audio {_duration(s.first_audio_s)}, "
            f"real-time factor {s.real_time_factor:.2f}")


def _left_out(c: ContextUse) -> str:
    if not c.turns_left_out:
        return ""
    return f"{_counted(c.turns_left_out, 'earlier turn')} left out to fit {c.prompt_limit:,} tokens"


def _duration(seconds: float) -> str:
    return f"{_figure(seconds * 1000)} ms" if seconds < 1 else f"{_figure(seconds)} s"


def _figure(value: float) -> str:
    """Two or three figures, as a person reads them at a glance: 3.2, 17, 1,420."""
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def _counted(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class Failed:
    message: str


Event = TextDelta | AudioChunk | Finished | Failed


@dataclass
class Request:
    """Created by the caller, then owned by the engine's worker thread until it finishes."""

    session: str
    messages: list[Message]
    params: SamplingParams
    seed: int
    speech: SpeechParams | None = None  # a spoken reply was asked for
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    # Filled by the worker:
    prompt: Prompt | None = None
    claim: Claim | None = None  # the session's cache entry and device slot, while running
    prepared: PreparedPrompt | None = None
    max_new_tokens: int = 0
    computed: int = 0  # prompt tokens this request computed
    reused: tuple[int, int] = (0, 0)  # prompt tokens whose KV came from the device, from host memory
    media: MediaCounts = field(default_factory=MediaCounts)
    turns_left_out: int = 0  # the chat's earliest turns the prompt leaves out, to fit max_prompt_tokens
    written: int = 0  # tokens of prompt-then-reply whose KV is in the slot, of accepted tokens only
    output_ids: list[int] = field(default_factory=list)  # the reply's tokens the host has accepted
    launched: int = 0  # reply tokens chosen on the device: the accepted ones and one of a step not read yet
    detokenizer: IncrementalDetokenizer | None = None
    streamed: str = ""  # the text sent as deltas so far
    started_at: float = 0.0
    first_token_at: float = 0.0
    text_done: bool = False  # the Thinker has finished; its slot is given back
    text_done_at: float = 0.0
    stop_reason: StopReason = "end_of_turn"
    spoken: SpokenReply | None = None  # the speech, once the first token is known
    ended: bool = False  # Finished or Failed was sent: the engine is done with it

    @property
    def slot(self) -> int:
        return self.claim.entry.slot

    def counts(self, generated: int) -> TokenCounts:
        prompt = self.prompt.num_tokens if self.prompt else 0
        return TokenCounts(prompt, self.computed, *self.reused, generated)

    def timings(self) -> Timings:
        now = self.text_done_at or time.perf_counter()
        decode_s = now - self.first_token_at
        decoded = len(self.output_ids) - 1
        return Timings(
            queue_wait_s=(self.started_at or now) - self.submitted_at,
            ttft_s=(self.first_token_at or now) - self.submitted_at,
            decode_tokens_per_s=decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0,
        )
