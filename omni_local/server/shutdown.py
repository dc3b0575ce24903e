"""How `serve` stops (Ctrl-C, SIGTERM) without cutting a streamed reply silently. Replies still
streaming may go on for `shutdown_grace_s`; one that outlasts it ends with a chunk whose
`finish_reason` is "abort" (vLLM's word for it) and an error event (503, code
"server_shutting_down"), never `[DONE]`: the `openai` SDK raises it, and no client can take the cut
reply for a whole one.

sse-starlette notices the shutdown (it watches uvicorn) and sets each stream's own event; the grace
is counted from the first stream to notice, so all end together, and uvicorn waits `MARGIN_S` more
for their last events before it closes whatever is still open.
"""

from collections.abc import AsyncIterator

import anyio
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from omni_local.server.errors import ApiError
from omni_local.server.reply import ApiReply

MARGIN_S = 2.0  # sse-starlette notices within half a second; the last events then go at once


class ShuttingDown(ApiError):
    def __init__(self, grace_s: float) -> None:
        super().__init__(503, f"the server is shutting down: this reply was cut short after the {grace_s:g} s it "
                         "had to end (shutdown_grace_s)", "server_shutting_down")


class Draining:
    """The streams of one server, and the grace they have once it is told to stop."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._began: float | None = None  # when the first stream noticed the shutdown (anyio.current_time)

    def respond(self, reply: ApiReply, content: AsyncIterator[str]) -> EventSourceResponse:
        """`content`, the chunks of `reply`, as server-sent events; `reply` is cut once the grace is over."""
        return DrainedStream(content, reply, self)

    async def over(self, noticed: anyio.Event) -> None:
        """Returns once the grace is over after the shutdown that sets `noticed`."""
        await noticed.wait()
        if self._began is None:
            self._began = anyio.current_time()
        await anyio.sleep_until(self._began + self.grace_s)


class DrainedStream(EventSourceResponse):
    """A stream with a watcher beside it, which cuts its reply when the grace after the shutdown is over
    (its content then sends the reply's last events): sse-starlette would otherwise cancel the
    content once the shutdown comes, and end the stream as if it were whole."""

    def __init__(self, content: AsyncIterator[str], reply: ApiReply, draining: Draining) -> None:
        self._noticed = anyio.Event()
        super().__init__(content, shutdown_event=self._noticed, shutdown_grace_period=draining.grace_s + MARGIN_S)
        self._reply, self._draining = reply, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._cut_when_over)
            await super().__call__(scope, receive, send)
            group.cancel_scope.cancel()

    async def _cut_when_over(self) -> None:
        await self._draining.over(self._noticed)
        self._reply.cut(ShuttingDown(self._draining.grace_s))
