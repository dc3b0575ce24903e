"""A reply as the API server sends it, below the subprocess (test_server.py): stop strings across
the pieces of a streamed text, the session a stateless request continues, and a failure after the
stream began, through the server's routes in this process (Starlette's test client under the
official `openai` client)."""

from collections.abc import Iterator

import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from omni_local.access import LOCAL_USER
from omni_local.errors import RequestError
from omni_local.protocol.events import ContextUse, Finished, TextDelta, Timings, TokenCounts
from omni_local.protocol.messages import Message
from omni_local.server.conversations import Conversations
from omni_local.server.routes import api_mount
from omni_local.server.stops import StopStrings


def fed(stops: list[str], pieces: list[str]) -> tuple[list[str], StopStrings]:
    cutter = StopStrings(stops)
    return [cutter.feed(piece) for piece in pieces], cutter


def test_a_stop_string_across_two_pieces_cuts_the_text_where_it_begins():
    sent, cutter = fed(["o w"], ["Hel", "lo wo", "rld"])
    assert sent == ["Hel", "l", ""] and cutter.stopped


def test_the_first_of_several_stop_strings_cuts_the_text():
    sent, cutter = fed(["world", "lo"], ["Hello world"])
    assert sent == ["Hel"] and cutter.stopped


def test_text_that_only_begins_like_a_stop_string_is_held_back_then_sent():
    sent, cutter = fed(["END"], ["the E", "ast", " and the EN"])
    assert sent == ["the ", "East", " and the "] and not cutter.stopped
    assert cutter.flush() == "EN"


class FailingMidway:
    """A backend whose replies fail after their first piece of text, as a request whose input turns
    out bad only while it decodes does."""

    def __init__(self, info) -> None:
        self.info = info

    def send(self, *request: object) -> "FailingMidway":
        return self

    def events(self) -> Iterator[TextDelta]:
        yield TextDelta("Hel")
        raise RequestError("the model's output was not a number")

    def cancel(self) -> None:
        pass


def reply(text: str, token_ids: list[int]) -> Finished:
    return Finished(text, token_ids, "end_of_turn", TokenCounts(9, 9, 0, 0, len(token_ids)), Timings(0, 0, 0), 1,
                    ContextUse(64, 48))


def test_a_conversation_sent_again_with_its_reply_continues_its_session_once_and_gets_the_replys_token_ids():
    conversations = Conversations()
    asked = [Message("system", ["Be brief."]), Message("user", ["Hello."])]
    session, _ = conversations.continued(LOCAL_USER, asked)
    conversations.remember(LOCAL_USER, session, asked, reply("Hi there.", [7, 8, 9]))
    follow_up = [*asked, Message("assistant", ["Hi there."]), Message("user", ["And then?"])]
    continued, messages = conversations.continued(LOCAL_USER, follow_up)
    assert continued == session and messages[2].token_ids == [7, 8, 9]
    other, _ = conversations.continued(LOCAL_USER, follow_up)  # the session is held by the request that took it
    assert other != session
    stranger, _ = conversations.continued(LOCAL_USER, [Message("user", ["Hello."])])
    assert stranger not in (session, other)


def test_a_conversation_sent_again_by_another_principal_continues_no_session_of_the_first_nor_gets_its_token_ids():
    conversations = Conversations()
    asked = [Message("user", ["Hello."])]
    session, _ = conversations.continued("api key ada", asked)
    conversations.remember("api key ada", session, asked, reply("Hi there.", [7, 8, 9]))
    follow_up = [*asked, Message("assistant", ["Hi there."]), Message("user", ["And then?"])]
    other, messages = conversations.continued("api key bob", follow_up)
    assert other != session and messages[1].token_ids is None
    continued, messages = conversations.continued("api key ada", follow_up)  # still there for Ada
    assert continued == session and messages[1].token_ids == [7, 8, 9]

def test_a_failure_after_the_stream_began_is_an_error_event_the_sdk_raises(app, monkeypatch):
    monkeypatch.setattr(app, "backend", FailingMidway(app.backend.info))
    http = TestClient(Starlette(routes=[api_mount(app, None)]))
    api = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)
    seen = []
    with pytest.raises(openai.APIError, match="the model's output was not a number"):
        for chunk in api.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                 stream=True):
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["Hel"]
