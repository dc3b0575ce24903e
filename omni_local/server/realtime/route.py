"""`/v1/realtime`: the WebSocket a realtime client talks to (Starlette's WebSocket; no framing of ours).

Each connection is one session (session.py). A message that cannot be read, or that is over
`MAX_MESSAGE_BYTES`, is answered with an `error` event and the session goes on. At most
`api_max_requests` sessions are held at once: one more is answered with an error event and closed
(1013, try again later). A session that sends nothing for `IDLE_SECONDS` while no response runs
is told so in an error event and closed (1000), so a tab left open does not hold a seat for ever.
A client that goes away cancels its response: the engine stops making it.
The admission checks (admission.py) let the connection in first: its key, its principal.
"""

import asyncio

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect

from omni_local.api import OmniLocal
from omni_local.server.admission import PRINCIPAL
from omni_local.server.realtime.client_events import EventError, read_event
from omni_local.server.realtime.server_events import error_event
from omni_local.server.realtime.session import RealtimeSession, Send

# Under uvicorn's own limit on a message (16 MiB, past which it drops the connection), so that a
# message over it is answered: 8 MiB of base64 is 131 s of 24 kHz PCM16 in one append.
MAX_MESSAGE_BYTES = 8 << 20
TRY_AGAIN_LATER = 1013
SUBPROTOCOL = "realtime"  # what browsers offer beside their key (admission.py); accepted back
# A client with server VAD streams its microphone without pause, and one typing sends an event a
# turn: a quarter of an hour with neither is a session nobody uses any more.
IDLE_SECONDS = 15 * 60


class RealtimeRoute:
    def __init__(self, app: OmniLocal, max_sessions: int, idle_seconds: float = IDLE_SECONDS) -> None:
        self.app = app
        self.max_sessions, self.idle_seconds = max_sessions, idle_seconds
        self.sessions = 0  # on the server's one event loop: changed between awaits, never raced
        # Each session waits in at most two threads at once: its VAD, and its response's next event.
        self.threads = anyio.CapacityLimiter(2 * self.max_sessions)

    async def connect(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols", [])
        await websocket.accept(SUBPROTOCOL if SUBPROTOCOL in offered else None)
        sending = asyncio.Lock()  # one message at a time, from the receiving loop and the response

        async def send(event: dict) -> None:
            async with sending:
                await websocket.send_json(event)

        refusal = self._refusal(websocket)
        if refusal is not None:
            await send(refusal)
            await websocket.close(TRY_AGAIN_LATER if refusal["error"]["code"] == "session_limit" else 1008)
            return
        self.sessions += 1
        session = RealtimeSession(self.app, websocket.scope[PRINCIPAL], send, self.threads)
        try:
            await session.begin()
            await self._serve(websocket, session, send)
        except WebSocketDisconnect:
            pass
        finally:
            self.sessions -= 1
            await session.close()

    def _refusal(self, websocket: WebSocket) -> dict | None:
        if self.sessions >= self.max_sessions:
            return error_event(f"the server holds {self.max_sessions} realtime sessions already "
                               "(api_max_requests): try again soon", "session_limit", kind="rate_limit_exceeded")
        model = websocket.query_params.get("model")
        if model is not None and model != self.app.info.model_id:
            return error_event(f"the model '{model}' is not served here: this server serves "
                               f"'{self.app.info.model_id}'", "model_not_found", "model")
        return None

    async def _serve(self, websocket: WebSocket, session: RealtimeSession, send: Send) -> None:
        while True:
            with anyio.move_on_after(self.idle_seconds) as waiting:
                message = await websocket.receive()
            if waiting.cancelled_caught:
                if session.response is not None:
                    continue  # the client listens to a reply
                await send(error_event(f"the session sent nothing for {self.idle_seconds:g} s: closed, its seat "
                                       "given back; connect again to go on", "session_idle"))
                await websocket.close(1000)
                return
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text") if message.get("text") is not None else message.get("bytes", b"")
            event = None
            try:
                size = len(data.encode() if isinstance(data, str) else data)
                if size > MAX_MESSAGE_BYTES:
                    raise EventError(f"the message is {size:,} bytes, over the limit of {MAX_MESSAGE_BYTES:,}: "
                                     "send audio in smaller appends", "message_too_large")
                event = read_event(data)
                await session.handle(event)
            except EventError as error:
                event_id = error.event_id or getattr(event, "event_id", None)
                await send(error_event(error.message, error.code, error.param, event_id))
