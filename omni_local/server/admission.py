"""Who gets in, before any route reads a request: the key (401), the body's size (413), and how many
chat completions the server holds at once (429).

A body may be at most `MAX_BODY_UPLOADS` times `max_upload_bytes`: room for three media at the
upload limit, base64-encoded (a third larger), and the text around them; one media item over the
limit is refused by its own check (also 413). A body that says its length is refused before a byte
of it is read; one sent in chunks, once it is past the bound.

A chat completion is held from the moment it is let in until its response ends (a stream's last
event, or the client gone): queued in the engine, decoding, or speaking. One more than
`api_max_requests` is answered at once with 429 and Retry-After, never queued: a client can tell a
full server from a slow one.
"""

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_local.server.errors import ApiError

MAX_BODY_UPLOADS = 4
RETRY_AFTER_S = 1


class Admission:
    def __init__(self, app: ASGIApp, key: str | None, max_body_bytes: int, max_requests: int) -> None:
        self.app = app
        self.key = key
        self.max_body_bytes = max_body_bytes
        self.max_requests = max_requests
        self.held = 0  # chat completions let in and not yet answered; all on the server's one event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(Headers(scope=scope))
        counted = scope["path"].endswith("/chat/completions")
        if refusal is None and counted and self.held >= self.max_requests:
            refusal = ApiError(429, f"the server holds {self.max_requests} requests already (api_max_requests): "
                               "try again soon", "rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        if not counted:
            await self.app(scope, self._bounded(receive), send)
            return
        self.held += 1
        try:
            await self.app(scope, self._bounded(receive), send)
        finally:
            self.held -= 1

    def _refusal(self, headers: Headers) -> ApiError | None:
        if self.key is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:
                return ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer KEY'",
                                "invalid_api_key")
            if not hmac.compare_digest(given.strip().encode(), self.key.encode()):
                return ApiError(401, "the API key is wrong", "invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return ApiError(413, self._too_large(int(length)), "request_too_large")
        return None

    def _bounded(self, receive: Receive) -> Receive:
        read = 0

        async def bounded() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_body_bytes:
                raise HTTPException(413, self._too_large(read))  # answered by the API's error handler
            return message

        return bounded

    def _too_large(self, size: int) -> str:
        return (f"the request body is {size:,} bytes, over the limit of {self.max_body_bytes:,} "
                f"({MAX_BODY_UPLOADS} × max_upload_bytes)")
