"""Spoken replies in a realtime session (in this process, the app with the Talker): one cut short,
which the client truncates at the audio it played, leaves in the next turn's prompt exactly the
transcript that had been sent with that audio; one that calls a tool is spoken up to the call, and
the call follows as its item."""

import base64

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from forced_replies import forced_replies
from omni_local.server.routes import api_mount
from realtime_events import of, until

END = "<|im_end|>"
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
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


def test_a_spoken_response_that_calls_a_tool_speaks_its_text_then_sends_the_function_call_item(speaking_app):
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    http = TestClient(Starlette(routes=[api_mount(speaking_app, None)]))
    with forced_replies(speaking_app.backend.engine, speaking_app.backend.loaded.processor.tokenizer,
                        f"I will check. {PARIS}{END}"), http.websocket_connect("/v1/realtime") as ws:
        until(ws, "session.created")
        ws.send_json(TYPED_SPOKEN)
        until(ws, "session.updated")
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}})
        until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create", "response": {"tools": [tool], "max_output_tokens": 64}})
        events = until(ws, "response.done")
    kinds = [event["type"] for event in events]
    done = events[-1]["response"]
    assert done["status"] == "completed" and [item["type"] for item in done["output"]] == ["message", "function_call"]
    assert done["output"][0]["content"][0]["transcript"] == "I will check."
    assert of(events, "response.function_call_arguments.done")[0]["name"] == "get_weather"
    # The call's item comes after the message's audio, all of it.
    assert len(of(events, "response.output_audio.delta")) > 0
    assert kinds.index("response.output_audio.done") < kinds.index("response.function_call_arguments.done")
