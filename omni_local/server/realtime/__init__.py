"""OpenAI's Realtime API (GA) over a WebSocket at /v1/realtime: one connection is one spoken (or
typed) conversation with the model, with server VAD, barge-in, tool calls and the conversation's KV
reused turn after turn.

    client_events.py  the client's events, read and checked
    server_events.py  the server's events, ids, errors, usage
    config.py         the session's configuration (session.update)
    input_audio.py    the input audio buffer, resampled to 16 kHz, and server VAD over it
    conversation.py   the conversation's items, the prompt's messages, truncation of a spoken reply
    response.py       one response: the backend's reply as response events
    session.py        one session: the client's events handled
    route.py          the WebSocket: limits, errors, disconnects

docs/realtime.md lists the events supported.
"""

from omni_local.server.realtime.route import RealtimeRoute

__all__ = ["RealtimeRoute"]
