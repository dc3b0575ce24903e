"""A realtime conversation answers alike with the prefix cache on and off (greedy replies): its
items are the record the prompt is built from, so reusing the chat's KV changes nothing but the
work, even after an item is deleted from the middle of the conversation."""

from starlette.applications import Starlette
from starlette.testclient import TestClient

from omni_local.server.routes import api_mount
from realtime_events import of, say, typed_session, until


def conversation(app) -> tuple[list[str], list[int]]:
    """Three typed turns, the first reply deleted before the third: each reply's text and cached tokens."""
    http = TestClient(Starlette(routes=[api_mount(app, None)]))
    with http.websocket_connect("/v1/realtime") as ws:
        typed_session(ws)
        turns = [say(ws, "What is a lighthouse?"), say(ws, "Who keeps one?")]
        ws.send_json({"type": "conversation.item.delete", "item_id": turns[0][-1]["response"]["output"][0]["id"]})
        until(ws, "conversation.item.deleted")
        turns.append(say(ws, "Tell me more."))
    texts = ["".join(event["delta"] for event in of(turn, "response.output_text.delta")) for turn in turns]
    return texts, [turn[-1]["response"]["usage"]["input_token_details"]["cached_tokens"] for turn in turns]


def test_a_realtime_conversation_replies_alike_with_the_prefix_cache_on_and_off(apps):
    (on_texts, on_cached), (off_texts, off_cached) = conversation(apps[0]), conversation(apps[1])
    assert on_texts == off_texts and all(on_texts)
    assert on_cached[1] > 0 and off_cached == [0, 0, 0]
