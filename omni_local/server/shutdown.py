"""How `serve` stops (Ctrl-C, SIGTERM) without cutting a streamed reply silently. Replies still
streaming may go on for `shutdown_grace_s`; one that outlasts it ends with a chunk whose
`finish_reason` is "abort" (vLLM's word for it) and an error event (503, code
"server_shutting_down"), never `[DONE]`: the `openai` SDK raises it, and no client can take the cut
reply for a whole one.

sse-starlette notices the shutdown (it watches uvicorn) and sets each stream's own event; the grace
is counted from the first stream to notice, so all end together, and uvicorn waits `MARGIN_S` more
for their last events before it closes whatever is still open.
"""

from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
from sse_starlette import EventSourceResponse

from omni_local.server.errors import ApiError
from omni_local.server.races import unless

T = TypeVar("T")
MARGIN_S = 2.0  # sse-starlette notices within half a second; the last events then go at once
_END = object()


class ShuttingDown(ApiError):
    def __init__(self, grace_s: float) -> None:
        super().__init__(503, f"the server is shutting down: this reply was cut short after the {grace_s:g} s it "
                         "had to end (shutdown_grace_s)", "server_shutting_down")


class Draining:
    """The streams of one server, and the grace they have once it is told to stop."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._began: float | None = None  # when the first stream noticed the shutdown (anyio.current_time)

    def respond(self, content: Callable[[anyio.Event], AsyncIterator[str]]) -> EventSourceResponse:
        """A server-sent stream of `content`, which is given the event set once the server stops."""
        noticed = anyio.Event()
        return EventSourceResponse(content(noticed), shutdown_event=noticed,
                                   shutdown_grace_period=self.grace_s + MARGIN_S)

    async def until_over(self, events: AsyncIterator[T], noticed: anyio.Event) -> AsyncIterator[T]:
        """`events` as they come; `ShuttingDown` if the grace after `noticed` is over first."""
        while (event := await unless(anext(events, _END), lambda: self._over(noticed))) is not _END:
            if event is None:
                raise ShuttingDown(self.grace_s)
            yield event

    async def _over(self, noticed: anyio.Event) -> None:
        await noticed.wait()
        if self._began is None:
            self._began = anyio.current_time()
        await anyio.sleep_until(self._began + self.grace_s)
