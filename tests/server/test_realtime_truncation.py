"""Spoken replies in a realtime session (in this process, the app with the Talker): one cut short,
which the client truncates at the audio it played, leaves in the next turn's prompt exactly the
transcript that had been sent with that audio; one that offers tools is refused."""

import base64

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from omni_local.server.routes import api_mount
from realtime_events import of, until

TYPED_SPOKEN = {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"],
                                                      "audio": {"input": {"turn_detection": None}}}}


@pytest.fixture
def sent(speaking_app, monkeypatch) -> list:
    """The messages of each prompt the sessions send the backend, in order."""
    prompts, send = [], speaking_app.backend.send

    def sending(*args, **kwargs):
        prompts.append(args[1])
        return send(*args, **kwargs)

    monkeypatch.setattr(speaking_app.backend, "send", sending)
    return prompts


def ask(ws, text: str) -> None:
    ws.send_json({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    until(ws, "conversation.item.done")
    ws.send_json({"type": "response.create", "response": {"max_output_tokens": 24}})


def test_a_reply_truncated_at_its_first_audio_keeps_the_transcript_sent_before_it_in_the_next_prompt(
        speaking_app, sent):
    http = TestClient(Starlette(routes=[api_mount(speaking_app, None)]))
    with http.websocket_connect("/v1/realtime") as ws:
        until(ws, "session.created")
        ws.send_json(TYPED_SPOKEN)
        until(ws, "session.updated")
        ask(ws, "Tell me a long story.")
        begun = until(ws, "response.output_audio.delta")
        reply = of(begun, "response.output_item.added")[0]["item"]
        heard = "".join(event["delta"] for event in of(begun, "response.output_audio_transcript.delta"))
        first_audio_ms = len(base64.b64decode(begun[-1]["delta"])) // 2 * 1000 // 24_000
        ws.send_json({"type": "response.cancel"})
        # Truncated at once, as a client does, before the cancelled response's end.
        ws.send_json({"type": "conversation.item.truncate", "item_id": reply["id"], "content_index": 0,
                      "audio_end_ms": first_audio_ms})
        events = until(ws, "conversation.item.truncated")
        done = (of(events, "response.done") or until(ws, "response.done"))[-1]["response"]
        ask(ws, "Go on.")
        until(ws, "response.done")
    assert done["status"] == "cancelled" and done["output"][0]["content"][0]["transcript"] == heard
    assert [(m.role, m.text) for m in sent[1]] == [("user", "Tell me a long story."), ("assistant", heard),
                                                   ("user", "Go on.")]
    kept = sent[1][1].token_ids  # the model's own ids only where they are the text kept, else none
    assert kept is None or speaking_app.backend.loaded.processor.tokenizer.decode(kept) == heard


def test_a_spoken_response_that_offers_tools_is_refused_with_an_error_event(speaking_app):
    http = TestClient(Starlette(routes=[api_mount(speaking_app, None)]))
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    with http.websocket_connect("/v1/realtime") as ws:
        until(ws, "session.created")
        ws.send_json(TYPED_SPOKEN)
        until(ws, "session.updated")
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}})
        until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create", "response": {"tools": [tool]}})
        assert "a spoken reply cannot call tools" in until(ws, "error")[-1]["error"]["message"]
        assert until(ws, "response.done")[-1]["response"]["status"] == "failed"
