"""A request's state as it passes through the engine, and what it streams back (the API's events, or
`Failed`)."""

import queue
import threading
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from omni_local.access import LOCAL_USER
from omni_local.engine.detokenizer import IncrementalDetokenizer
from omni_local.engine.forward.prefill_chunks import PreparedPrompt
from omni_local.engine.forward.speech import SpokenReply
from omni_local.engine.memory.kv_store import BlockTable
from omni_local.engine.memory.prefix_cache import Claim
from omni_local.engine.prompt.builder import Prompt
from omni_local.engine.reasoning import ReasoningText
from omni_local.protocol.events import (
    AudioChunk,
    Finished,
    MediaCounts,
    ReasoningDelta,
    StopReason,
    TextDelta,
    TokenCounts,
    TokenLogprob,
    Timings,
    Waiting,
)
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams, SpeechParams


@dataclass(frozen=True)
class Failed:
    """The request failed: `message` is for the person who asked."""

    message: str


# What the engine puts on a request's queue: the protocol's events (protocol/events.py, `Event`), or
# Failed, which the local backend raises as the request's error instead of passing it on.
EngineEvent = Waiting | TextDelta | ReasoningDelta | AudioChunk | Finished | Failed


class State(Enum):
    """Where a request is in the engine. Speech is no state of its own: a spoken reply speaks from
    its first token on, while it decodes and after its text is done (or, up to a tool call's opening,
    while the Thinker writes the call)."""

    WAITING = auto()  # in line for a seat and blocks, its prompt built (or why it could not be)
    PREFILLING = auto()  # admitted: part of its prompt is not in its blocks yet
    DECODING = auto()  # its prompt computed: a token a turn, the first chosen after its prompt's last part
    PARKED = auto()  # preempted: its KV in host memory, its seat kept, until blocks free
    TEXT_DONE = auto()  # the Thinker is done: its seat and blocks given back; its speech may go on
    DONE = auto()  # Finished or Failed was sent: the engine is done with it


# Where each state may go. The text may end from any state before TEXT_DONE: a cancel, a failure.
MOVES: dict[State, frozenset[State]] = {
    State.WAITING: frozenset({State.PREFILLING, State.TEXT_DONE}),
    State.PREFILLING: frozenset({State.DECODING, State.TEXT_DONE}),
    State.DECODING: frozenset({State.PARKED, State.TEXT_DONE}),
    State.PARKED: frozenset({State.DECODING, State.TEXT_DONE}),
    State.TEXT_DONE: frozenset({State.DONE}),
    State.DONE: frozenset(),
}


@dataclass
class Request:
    """Created by the caller, given its prompt by the engine's prompt builder, then owned by the
    engine's worker thread until it finishes."""

    session: str
    messages: list[Message]
    params: SamplingParams
    seed: int
    speech: SpeechParams | None = None  # a spoken reply was asked for
    call_open: int | None = None  # the token opening a tool call, where the reply may make one: never spoken
    principal: str = LOCAL_USER  # whose (access.py): its caches are shared with this principal's requests alone
    events: "queue.Queue[EngineEvent]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    # Filled by the prompt builder:
    prompt: Prompt | None = None
    turns_left_out: int = 0  # the chat's earliest turns the prompt leaves out, to fit max_prompt_tokens
    prompt_built_s: float = 0.0  # spent building its prompt (not waiting: the engine's work on it)
    build_error: Exception | None = None  # why its prompt could not be built: the worker fails it
    # Filled by the worker:
    ahead: int = 0  # while it waits in line: the replies before it, as its last `Waiting` told
    claim: Claim | None = None  # the session's cache entry and its blocks, while running
    seat: int | None = None  # its row in the sampler, from admission until its text ends
    prepared: PreparedPrompt | None = None  # from its prefill's first part on, until its text ends
    prefilled: int = 0  # prompt rows in its blocks: the cached prefix, then each part computed
    max_new_tokens: int = 0
    computed: int = 0  # prompt tokens this request computed
    reused: tuple[int, int] = (0, 0)  # prompt tokens whose KV came from the device, from host memory
    media: MediaCounts = field(default_factory=MediaCounts)
    written: int = 0  # tokens of prompt-then-reply whose KV is in its blocks, of accepted tokens only
    output_ids: list[int] = field(default_factory=list)  # the reply's tokens the host has accepted
    launched: int = 0  # reply tokens chosen on the device: the accepted ones and one of a step not read yet
    detokenizer: IncrementalDetokenizer | None = None  # the answer's
    streamed: str = ""  # the answer sent as deltas so far
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # of answer tokens whose text is not sent yet
    reasoning: ReasoningText | None = None  # a Thinking checkpoint's reply
    started_at: float = 0.0  # admitted: a seat taken and its blocks claimed
    first_token_at: float = 0.0
    text_done_at: float = 0.0
    stop_reason: StopReason = "end_of_turn"
    spoken: SpokenReply | None = None  # the speech, once the first token is known
    call_opened: int | None = None  # the index in `output_ids` of the first `call_open`: the speech ends there
    state: State = State.WAITING  # changed by `move` alone

    def move(self, to: State) -> None:
        assert to in MOVES[self.state], f"a request cannot go from {self.state.name} to {to.name}"
        self.state = to

    @property
    def text_done(self) -> bool:
        """The Thinker has finished with it: its seat and blocks are given back."""
        return self.state in (State.TEXT_DONE, State.DONE)

    @property
    def ended(self) -> bool:
        return self.state is State.DONE

    @property
    def speaking(self) -> bool:
        """Its speech has frames to come: a spoken reply that has begun and not ended."""
        return self.spoken is not None and not self.spoken.done and not self.ended

    @property
    def spoken_text(self) -> tuple[list[int], bool]:
        """The reply's tokens its speech reads so far, and whether they are all: a tool call's opening
        ends them as the end of turn ends the text, so the Talker never speaks the call."""
        if self.call_opened is None:
            return self.output_ids, self.text_done
        return self.output_ids[:self.call_opened + 1], True

    @property
    def table(self) -> BlockTable:
        return self.claim.entry.table

    def admit(self) -> None:
        """A seat and blocks are its: its prompt's rows from the cached prefix on are its to compute."""
        self.prefilled = self.claim.start
        self.reused = (self.claim.reused_gpu, self.claim.reused_host)
        self.started_at = time.perf_counter()
        self.move(State.PREFILLING)

    def advance_prefill(self, end: int) -> None:
        """Its prompt rows up to `end` are in its blocks now; after the last, it decodes."""
        assert self.state is State.PREFILLING, self.state
        assert self.claim.start <= self.prefilled < end <= self.prompt.num_tokens, (self.prefilled, end)
        self.prefilled = end
        self.computed = end - self.claim.start
        if end == self.prompt.num_tokens:
            self.move(State.DECODING)

    def counts(self, generated: int) -> TokenCounts:
        prompt = self.prompt.num_tokens if self.prompt else 0
        return TokenCounts(prompt, self.computed, *self.reused, generated)

    def timings(self) -> Timings:
        now = self.text_done_at or time.perf_counter()
        decode_s = now - self.first_token_at
        decoded = len(self.output_ids) - 1
        return Timings(
            queue_wait_s=(self.started_at or now) - self.submitted_at - self.prompt_built_s,
            ttft_s=(self.first_token_at or now) - self.submitted_at,
            decode_tokens_per_s=decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0,
        )
