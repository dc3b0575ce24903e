"""A realtime session's events as a test reads them, on Starlette's test client's WebSocket: waiting
for an event of a kind, and a typed turn."""

ANSWERED = {"completed", "incomplete"}  # a reply that ended, or that max_output_tokens cut
TEXT_ONLY = {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                   "audio": {"input": {"turn_detection": None}}}}


def until(ws, kind: str) -> list[dict]:
    """The server's events up to and with the first of `kind`; an error or a response's end before it
    fails the test (rather than wait for what will not come)."""
    events = [ws.receive_json()]
    while events[-1]["type"] != kind:
        assert events[-1]["type"] not in {"error", "response.done"} - {kind}, events[-1]
        events.append(ws.receive_json())
    return events


def typed_session(ws, *updates: dict) -> None:
    until(ws, "session.created")
    for update in (TEXT_ONLY, *updates):
        ws.send_json(update)
        until(ws, "session.updated")


def say(ws, text: str, **response: object) -> list[dict]:
    """A user text item, then a response to it: its events up to response.done."""
    ws.send_json({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    until(ws, "conversation.item.done")
    ws.send_json({"type": "response.create", "response": {"max_output_tokens": 8, **response}})
    return until(ws, "response.done")


def of(events: list[dict], kind: str) -> list[dict]:
    return [event for event in events if event["type"] == kind]
