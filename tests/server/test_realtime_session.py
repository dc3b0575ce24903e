"""A realtime session through /v1/realtime's route, in this process (the app's engine on the demo
model, speech off): typed turns that reuse the conversation's KV, tool calls end to end (the demo's
replies forced to a call, forced_replies.py), bad input answered with an error event while the session
goes on, keys, the session limit, and a client that goes away."""

import base64
import json

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from forced_replies import forced_replies
from omni_local.access import ApiKeys
from omni_local.server.admission import Admission
from omni_local.server.realtime.route import IDLE_SECONDS, MAX_MESSAGE_BYTES, RealtimeRoute
from omni_local.server.routes import api_mount
from realtime_events import ANSWERED, TEXT_ONLY, of, say, typed_session, until
from waiting import came_true, within

END = "<|im_end|>"
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city, now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def http(app) -> TestClient:
    return TestClient(Starlette(routes=[api_mount(app, None)]))


@pytest.fixture
def sent(app, monkeypatch) -> list:
    """What each response sent the backend: (messages, reply), in order."""
    calls, send = [], app.backend.send

    def sending(*args, **kwargs):
        reply = send(*args, **kwargs)
        calls.append((args[1], reply))
        return reply

    monkeypatch.setattr(app.backend, "send", sending)
    return calls


def test_a_typed_turn_streams_text_deltas_that_add_up_to_the_item_and_the_next_turn_reuses_it(http, sent):
    with http.websocket_connect("/v1/realtime?model=demo") as ws:
        typed_session(ws)
        first = say(ws, "Hello there.")
        second = say(ws, "And then?")
    deltas = "".join(event["delta"] for event in of(first, "response.output_text.delta"))
    done = first[-1]["response"]
    assert done["status"] in ANSWERED and done["output"][0]["content"][0] == {"type": "output_text", "text": deltas}
    assert of(first, "response.output_text.done")[0]["text"] == deltas
    assert [m.role for m in sent[1][0]] == ["user", "assistant", "user"] and sent[1][0][1].text == deltas
    usage = second[-1]["response"]["usage"]
    assert usage["input_tokens"] > done["usage"]["input_tokens"] > 0
    assert usage["input_token_details"]["cached_tokens"] >= done["usage"]["input_tokens"]


def test_a_forced_call_is_a_function_call_item_and_its_output_sent_back_is_answered(app, http, sent):
    tokenizer = app.backend.loaded.processor.tokenizer
    tools = {"type": "session.update", "session": {"type": "realtime", "tools": [WEATHER], "tool_choice": "auto"}}
    with forced_replies(app.backend.engine, tokenizer, PARIS + END, "It is sunny." + END), \
            http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws, tools)
        called = say(ws, "Weather in Paris?", max_output_tokens=64)
        done = of(called, "response.function_call_arguments.done")[0]
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": done["call_id"], "output": "sunny, 21 C"}})
        until(ws, "conversation.item.done")
        ws.send_json({"type": "response.create"})
        answered = until(ws, "response.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"} and done["name"] == "get_weather"
    assert json.loads("".join(e["delta"] for e in of(called, "response.function_call_arguments.delta"))) == {
        "city": "Paris"}
    assert [item["type"] for item in called[-1]["response"]["output"]] == ["function_call"]
    assert "".join(e["delta"] for e in of(answered, "response.output_text.delta")) == "It is sunny."
    messages = sent[1][0]
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].tool_calls[0].id == done["call_id"] and messages[2].text == "sunny, 21 C"


def test_an_output_for_a_call_never_made_is_refused_and_the_session_goes_on(http):
    with http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws)
        ws.send_json({"type": "conversation.item.create", "event_id": "mine", "item": {
            "type": "function_call_output", "call_id": "call_nobody", "output": "x"}})
        error = ws.receive_json()["error"]
        assert error["param"] == "item.call_id" and error["event_id"] == "mine"
        assert say(ws, "Still there?")[-1]["response"]["status"] in ANSWERED


@pytest.mark.parametrize("event, code", [
    ({"type": "response.teleport"}, "unknown_event_type"),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_base64"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}},
     "invalid_value"),
    ({"type": "response.cancel"}, "response_cancel_not_active"),
    ({"type": "conversation.item.truncate", "item_id": "item_none", "content_index": 0, "audio_end_ms": 0},
     "item_not_found"),
])
def test_bad_input_gets_an_error_event_and_the_session_answers_after_it(http, event, code):
    with http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws)
        ws.send_json(event)
        assert ws.receive_json()["error"]["code"] == code
        assert say(ws, "Still there?")[-1]["response"]["status"] in ANSWERED


def test_a_message_over_the_limit_gets_an_error_event_and_the_session_goes_on(http):
    audio = base64.b64encode(bytes(MAX_MESSAGE_BYTES)).decode()  # 4/3 of the limit once in base64
    with http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws)
        ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
        assert ws.receive_json()["error"]["code"] == "message_too_large"
        ws.send_json({"type": "input_audio_buffer.clear"})
        until(ws, "input_audio_buffer.cleared")


def long_reply_begun(ws) -> None:
    """A typed session whose response has begun a reply of up to 900 tokens (many seconds here)."""
    typed_session(ws)
    ws.send_json({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}})
    ws.send_json({"type": "response.create", "response": {"max_output_tokens": 900}})
    until(ws, "response.output_text.delta")


def test_a_response_asked_while_one_runs_is_refused_and_a_cancelled_one_ends_cancelled(http):
    with http.websocket_connect("/v1/realtime") as ws:
        long_reply_begun(ws)
        ws.send_json({"type": "response.create"})
        assert until(ws, "error")[-1]["error"]["code"] == "conversation_already_has_active_response"
        ws.send_json({"type": "response.cancel"})
        done = until(ws, "response.done")[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    assert done["output"][0]["status"] == "incomplete"


def test_a_client_that_goes_away_cancels_its_reply(http, sent):
    with http.websocket_connect("/v1/realtime") as ws:
        long_reply_begun(ws)
    reply = sent[0][1]
    assert came_true(reply.request.cancelled.is_set, 10), "the reply's request was not cancelled"


def route_app(app, keys: ApiKeys | None = None, sessions: int = 1, idle_seconds: float = IDLE_SECONDS) -> TestClient:
    routes = [WebSocketRoute("/realtime", RealtimeRoute(app, sessions, idle_seconds).connect)]
    return TestClient(Starlette(routes=routes, middleware=[Middleware(Admission, keys=keys, settings=app.settings)]))


def test_a_session_past_the_limit_gets_an_error_event_and_is_closed_while_the_others_go_on(app):
    http = route_app(app, sessions=1)
    with http.websocket_connect("/realtime") as first:
        until(first, "session.created")
        with http.websocket_connect("/realtime") as second:
            assert second.receive_json()["error"]["code"] == "session_limit"
            with pytest.raises(WebSocketDisconnect) as closed:
                second.receive_json()
            assert closed.value.code == 1013
        first.send_json(TEXT_ONLY)
        until(first, "session.updated")


def test_a_session_idle_past_its_time_is_told_and_closed_and_its_seat_serves_the_next(app):
    http = route_app(app, sessions=1, idle_seconds=1.0)
    with http.websocket_connect("/realtime") as idle:
        until(idle, "session.created")
        # Starlette's test socket has no receive timeout: a server that never told would hang the run.
        assert within(idle.receive_json, "the idle session must be told")["error"]["code"] == "session_idle"
        with pytest.raises(WebSocketDisconnect) as closed:
            idle.receive_json()
        assert closed.value.code == 1000
    with http.websocket_connect("/realtime") as next_one:
        until(next_one, "session.created")
        next_one.send_json(TEXT_ONLY)
        until(next_one, "session.updated")


def test_a_wrong_model_is_refused(http):
    with http.websocket_connect("/v1/realtime?model=gpt-realtime") as ws:
        assert ws.receive_json()["error"]["code"] == "model_not_found"


def test_a_key_is_needed_as_a_header_or_as_a_browsers_subprotocol(app):
    http = route_app(app, ApiKeys({"sesame": "ali"}), sessions=4)
    with pytest.raises(WebSocketDisconnect), http.websocket_connect("/realtime") as ws:
        ws.receive_json()
    with http.websocket_connect("/realtime", headers={"Authorization": "Bearer sesame"}) as ws:
        assert ws.receive_json()["type"] == "session.created"
    with http.websocket_connect("/realtime", subprotocols=["realtime", "openai-insecure-api-key.sesame"]) as ws:
        assert ws.accepted_subprotocol == "realtime" and ws.receive_json()["type"] == "session.created"


def test_a_deleted_item_is_left_out_of_the_next_prompt_and_a_conversation_with_nothing_to_answer_is_refused(
        http, sent):
    with http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws)
        say(ws, "First question.")
        ws.send_json({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Forget this."}]}})
        forgotten = until(ws, "conversation.item.done")[-1]["item"]["id"]
        ws.send_json({"type": "conversation.item.delete", "item_id": forgotten})
        assert until(ws, "conversation.item.deleted")[-1]["item_id"] == forgotten
        ws.send_json({"type": "response.create"})
        refused = until(ws, "error")
        assert refused[-1]["error"]["code"] == "nothing_to_answer"
        assert until(ws, "response.done")[-1]["response"]["status"] == "failed"
        say(ws, "Second question.")
    assert [(m.role, m.text) for m in sent[-1][0] if m.role == "user"] == [("user", "First question."),
                                                                           ("user", "Second question.")]
