"""A time limit on a request's headers, which uvicorn's own HTTP/1.1 protocol (h11) does not have: a
client that connects and sends nothing, or half its headers, or that leaves a kept-alive connection
with the first bytes of another request, would hold its socket for as long as it likes, and enough
of them every socket the process may open. Here a connection has `header_timeout_s` from when it
opens, and again from the end of each response, until a request's headers are all in; then it is
closed, with nothing sent. Once the headers are in, the body's time is the app's to limit
(admission.py); and while a response is being sent there is no limit.

`serve` passes the protocol to its uvicorn; Gradio makes the page's uvicorn itself, with no way to
pass one, so the page makes it uvicorn's "auto" protocol before it starts (`use_for_the_page`).
"""

import asyncio

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderTimeout(H11Protocol):
    timeout_s: float  # set by `timing_out_headers`
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # first: the next request may already be in, and reading it disarms
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a request's headers are in

    def handle_websocket_upgrade(self, event: object) -> None:
        self._disarm()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade(event)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        # uvicorn's own keep-alive timeout closes the same way: whatever came of a request is dropped.
        self._header_timer = self.loop.call_later(self.timeout_s, self.timeout_keep_alive_handler)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


def timing_out_headers(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request's headers take over `timeout_s`."""
    return type("HeaderTimeout", (_HeaderTimeout,), {"timeout_s": timeout_s})


def use_for_the_page(timeout_s: float) -> None:
    """Every uvicorn server this process starts afterwards with the default protocol ("auto", as Gradio
    starts the page's) times headers out after `timeout_s`."""
    HTTP_PROTOCOLS["auto"] = timing_out_headers(timeout_s)  # a class: uvicorn imports only a string
