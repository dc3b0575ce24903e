"""One reply as the API sends it: the backend's events, read without blocking the event loop, the
text cut at the request's stop strings.

A backend's reply is a blocking iterator (the engine's events come through a queue), so each event
is waited for in a worker thread. Whoever stops reading before the end (a client gone, a stop
string) cancels the reply, so the engine stops making it; so does `cut`, the server's shutdown.

The log-probabilities of the answer's tokens go with the text they make: held back while it is, and
at a stop string kept for the tokens whose text was sent, in whole or in part.
"""

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio
from anyio import to_thread

from omni_local.protocol.backend import ReplyStream
from omni_local.protocol.events import AudioChunk, Event, Finished, ReasoningDelta, TextDelta, TokenLogprob
from omni_local.protocol.functions import ToolCall
from omni_local.server.stops import StopStrings


class ApiReply:
    def __init__(self, stream: ReplyStream, stops: list[str], threads: anyio.CapacityLimiter) -> None:
        self._stream = stream
        self._backend_events = stream.events()
        self._stops = StopStrings(stops)
        self._threads = threads
        self._sent: list[str] = []
        self._sent_length = 0
        self._calls: list[ToolCall] = []  # the tool calls sent (none after a stop string)
        self._received = 0  # characters of the answer's text the backend sent
        # The log-probabilities of text not sent yet: where their text begins and ends in what was received.
        self._held: deque[tuple[int, int, tuple[TokenLogprob, ...]]] = deque()
        self.logprobs: list[TokenLogprob] = []  # of the text sent
        self.final: Finished | None = None
        self._cut: Exception | None = None
        self._waiting = anyio.CancelScope()  # around the wait for the backend's next event

    async def events(self) -> AsyncIterator[Event]:
        """Text (as it may be sent), audio, then the `Finished` of what was sent; a failure raises
        `OmniLocalError`, a `cut` its error."""
        try:
            while self.final is None:
                for sent in self._read(await self._next_event()):
                    yield sent
        finally:
            if self.final is None:
                self._stream.cancel()

    async def _next_event(self) -> Event:
        """The backend's next event, waited for in a worker thread; once the reply is cut, its error."""
        if self._cut is None:
            with anyio.CancelScope() as self._waiting:
                return await to_thread.run_sync(next, self._backend_events, limiter=self._threads,
                                                abandon_on_cancel=True)  # a client gone, or a cut, is not kept waiting
        raise self._cut

    def cut(self, error: Exception) -> None:
        """Ends the reply now: `events()` raises `error` instead of waiting for more."""
        self._cut = error
        self._waiting.cancel()

    def _read(self, event: Event) -> list[Event]:
        if isinstance(event, TextDelta):
            self._hold(event)
            was_stopped = self._stops.stopped
            text = self._stops.feed(event.text)
            if self._stops.stopped and not was_stopped:
                self._stream.cancel()  # the reply ends here; the engine's Finished follows
            return self._text(text)
        if isinstance(event, AudioChunk | ReasoningDelta | ToolCall):  # stop strings cut the answer only
            if self._stops.stopped:
                return []
            if isinstance(event, ToolCall):
                self._calls.append(event)
            return [event]
        if not isinstance(event, Finished):
            return []  # one OpenAI's stream has no field for: a `Waiting` (its place in line)
        tail = self._text(self._stops.flush())
        if self._stops.stopped:
            # The reply is what was sent, cut short (whether or not the engine ended it first): its
            # token ids no longer match it, and a call the model made after the stop string is not its.
            event = replace(event, text="".join(self._sent), token_ids=None, stop_reason="cancelled",
                            tool_calls=tuple(self._calls))
        self.final = event
        return [*tail, self.final]

    def _hold(self, event: TextDelta) -> None:
        begins, self._received = self._received, self._received + len(event.text)
        if event.logprobs:
            self._held.append((begins, self._received, event.logprobs))

    def _text(self, text: str) -> list[Event]:
        self._sent.append(text)
        self._sent_length += len(text)
        logprobs = self._release()
        return [TextDelta(text, logprobs)] if text or logprobs else []

    def _release(self) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of the tokens whose text is sent now; once a stop string has cut the
        reply, of those whose text begins before the cut (the others' text is never sent)."""
        released: list[TokenLogprob] = []
        while self._held and (self._held[0][1] <= self._sent_length
                              or self._stops.stopped and self._held[0][0] < self._sent_length):
            released += self._held.popleft()[2]
        self.logprobs += released
        return tuple(released)
