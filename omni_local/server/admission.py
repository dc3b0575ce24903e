"""Who gets in, before any route reads a request: a key (401; its holder is the request's principal,
access.py), the body (413 too large, 408 too slow, 429 when the bodies held at once fill their
budget), and how many chat completions the server holds at once (429).

A request is let in once its whole body has come, and only then counts against `api_max_requests`:
a client that sends half a request and waits holds nothing but its socket, and that for at most
`api_body_timeout_s` (from the end of its headers), when it is answered 408 and its connection
closed. Headers that do not come are timed out below this app, by the server (header_timeout.py).

A body may be at most `MAX_BODY_UPLOADS` times `max_upload_bytes`: room for three media at the
upload limit, base64-encoded (a third larger), and the text around them; one media item over the
limit is refused by its own check (also 413). A body that says its length is refused before a byte
of it is read; one sent in chunks, once it is past the bound. The bodies of all the requests being
read or answered share `api_body_budget_bytes`, counted as their bytes arrive and freed when the
request's response ends: a body that would pass it is refused (429), unless it is the only one held,
so that a body at its own bound always gets in alone.

A chat completion is held from the moment it is let in until its response ends (a stream's last
event, or the client gone): queued in the engine, decoding, or speaking. One more than
`api_max_requests` is answered at once with 429 and Retry-After, never queued: a client can tell a
full server from a slow one.

A WebSocket (the realtime API, realtime/) is let in by its key alone: the Authorization header, or
from a browser, which cannot send headers, the subprotocol `openai-insecure-api-key.KEY` as OpenAI's
clients offer it. A wrong one is refused 401 before the handshake; its route limits its sessions and
its messages.
"""

import asyncio
from collections import deque

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_local.access import LOCAL_USER, ApiKeys, api_principal
from omni_local.server.errors import ApiError
from omni_local.settings import Settings

MAX_BODY_UPLOADS = 4
RETRY_AFTER_S = 1
POLICY_VIOLATION = 1008  # a WebSocket's close code for a connection refused
KEY_SUBPROTOCOL = "openai-insecure-api-key."
PRINCIPAL = "omni_local.principal"  # the scope's key for whose request it is (access.py), set once let in


class _ClientGone(Exception):
    """The client closed its connection before its body was in: nobody to answer."""


class _Body:
    """A request's body as it came: its messages, until the app takes them, and its size in bytes, which
    counts against the budget until the request ends (the app holds the body, or what it made of it)."""

    def __init__(self) -> None:
        self.messages: deque[Message] = deque()
        self.size = 0

    def replaying(self, receive: Receive) -> Receive:
        """`receive` for the app: the body's messages already read, then the connection's own (its end)."""

        async def replay() -> Message:
            return self.messages.popleft() if self.messages else await receive()

        return replay


class Admission:
    def __init__(self, app: ASGIApp, keys: ApiKeys | None, settings: Settings) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = MAX_BODY_UPLOADS * settings.max_upload_bytes
        self.body_timeout_s = settings.api_body_timeout_s
        self.body_budget_bytes = settings.api_body_budget_bytes
        self.max_requests = settings.api_max_requests
        # Both on the server's one event loop: changed between awaits, never raced.
        self.held = 0  # chat completions let in and not yet answered
        self.body_bytes = 0  # of the bodies of the requests being read or answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = scope["path"].endswith("/chat/completions")
        body = _Body()
        try:
            refusal = await self._refusal(scope, receive, counted, body)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
            elif counted:
                await self._held(scope, body.replaying(receive), send)
            else:
                await self.app(scope, body.replaying(receive), send)
        except _ClientGone:
            pass
        finally:
            self.body_bytes -= body.size

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket (the realtime API) is let in by its key alone: its messages are limited by its route."""
        refusal = self._unkeyed(Headers(scope=scope), scope)
        if refusal is None:
            await self.app(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await refusal.response()(scope, receive, send)  # the 401 as an HTTP response, before the handshake
        else:
            await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": refusal.message[:120]})

    async def _held(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.held += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.held -= 1

    async def _refusal(self, scope: Scope, receive: Receive, counted: bool, body: _Body) -> ApiError | None:
        """Why the request is refused, its body read into `body` first; None if it is let in."""
        headers = Headers(scope=scope)
        refusal = self._unkeyed(headers, scope) or self._declared_too_large(headers)
        if refusal is None and counted:
            refusal = self._full()  # refused at once, while the body would still be on its way
        if refusal is not None:
            return refusal
        try:
            async with asyncio.timeout(self.body_timeout_s):
                await self._read(receive, body)
        except TimeoutError:
            return ApiError(408, f"the request body did not all come within {self.body_timeout_s:g} s "
                            "(api_body_timeout_s)", "request_timeout", headers={"Connection": "close"})
        except ApiError as error:
            return error
        return self._full() if counted else None

    async def _read(self, receive: Receive, body: _Body) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            size = len(message.get("body", b""))
            if body.size + size > self.max_body_bytes:
                raise ApiError(413, self._too_large(body.size + size), "request_too_large")
            if self.body_bytes + size > self.body_budget_bytes and self.body_bytes > body.size:  # others hold some
                raise _busy(f"the server holds {self.body_bytes:,} bytes of request bodies already, "
                            f"{self.body_budget_bytes:,} at most (api_body_budget_bytes)")
            body.messages.append(message)
            body.size += size
            self.body_bytes += size
            if not message.get("more_body", False):
                return

    def _unkeyed(self, headers: Headers, scope: Scope) -> ApiError | None:
        """A refusal for a missing or wrong key; else None, the key's holder the request's principal."""
        if self.keys is None:
            scope[PRINCIPAL] = LOCAL_USER
            return None
        given = _given_key(headers, scope)
        if given is None:
            return ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer KEY'",
                            "invalid_api_key")
        holder = self.keys.holder(given)
        if holder is None:
            return ApiError(401, "the API key is wrong", "invalid_api_key")
        scope[PRINCIPAL] = api_principal(holder)
        return None

    def _declared_too_large(self, headers: Headers) -> ApiError | None:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return ApiError(413, self._too_large(int(length)), "request_too_large")
        return None

    def _full(self) -> ApiError | None:
        if self.held < self.max_requests:
            return None
        return _busy(f"the server holds {self.max_requests} requests already (api_max_requests)")

    def _too_large(self, size: int) -> str:
        return (f"the request body is {size:,} bytes, over the limit of {self.max_body_bytes:,} "
                f"({MAX_BODY_UPLOADS} × max_upload_bytes)")


def _given_key(headers: Headers, scope: Scope) -> str | None:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given.strip():
        return given.strip()
    # A browser's WebSocket cannot send headers: OpenAI's realtime clients offer the key as a subprotocol.
    for protocol in scope.get("subprotocols", ()):
        if protocol.startswith(KEY_SUBPROTOCOL) and len(protocol) > len(KEY_SUBPROTOCOL):
            return protocol[len(KEY_SUBPROTOCOL):]
    return None


def _busy(why: str) -> ApiError:
    """429 for a server that is full now, not for a request at fault."""
    return ApiError(429, f"{why}: try again soon", "rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
