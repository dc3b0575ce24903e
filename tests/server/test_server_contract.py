"""The API's contract with OpenAI's clients, through the server's routes in this process (Starlette's
test client under the official `openai` client): the log-probabilities of a reply's tokens, whole and
streamed and through the Python API, against transformers' own forward; and each request field of
OpenAI's that the server does not implement refused with 400 naming it, while those harmless by their
definition change nothing. (test_server.py meets some of the same from a subprocess.)"""

from collections.abc import Iterator

import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from omni_local.protocol.events import (ContextUse, Finished, TextDelta, Timings, TokenChoice, TokenCounts,
                                   TokenLogprob)
from omni_local.protocol.messages import Message
from omni_local.server.routes import api_mount
from replies import NEW_TOKENS, model_logprobs, reference_tokens

QUESTION = "Tell me about the sea."
TOP = 5  # alternatives asked for per token
CLOSE = 1e-4  # the engine's forward over its KV beside transformers' over the whole sequence, in float32
NO_TOOLS = "no tools are given"
FUNCTIONS = "the older function calls are not supported"


@pytest.fixture(scope="module")
def sdk(app) -> openai.OpenAI:
    """The official client on the server's routes over `app`, in this process."""
    http = TestClient(Starlette(routes=[api_mount(app, None)]))
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


def ask(sdk: openai.OpenAI, content: object = QUESTION, **fields):
    return sdk.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}], **fields)


# Log-probabilities --------------------------------------------------------------------------------


def decoded(app, token: int) -> str | None:
    """The token's text as the tokenizer decodes it alone; None where it is part of a character."""
    text = app.backend.loaded.processor.tokenizer.decode([token])
    return None if "\ufffd" in text else text


def assert_the_models_logprobs(app, entries: list, tokens: list[int], expected) -> None:
    """`entries` (the SDK's, or the API's `TokenLogprob`s) hold each of `tokens`' log-probability in
    `expected` (model_logprobs) and its TOP best, with their texts and bytes."""
    assert len(entries) == len(tokens) > 8
    for entry, token, row in zip(entries, tokens, expected):
        top = entry.top if isinstance(entry, TokenLogprob) else entry.top_logprobs
        assert entry.logprob == pytest.approx(row[token].item(), abs=CLOSE)
        best = row.topk(TOP)
        assert [alternative.logprob for alternative in top] == pytest.approx(best.values.tolist(), abs=CLOSE)
        for alternative, other in [(entry, token), *zip(top, best.indices.tolist())]:
            text = decoded(app, other)
            utf8 = alternative.utf8 if isinstance(alternative, TokenChoice) else bytes(alternative.bytes)
            if text is not None:
                assert (alternative.token, utf8) == (text, text.encode())
            else:  # part of a character: its bytes, written as OpenAI writes them
                assert alternative.token == "bytes:" + "".join(f"\\x{byte:02x}" for byte in utf8)


def test_a_greedy_replys_logprobs_are_the_models_own_whole_and_streamed_each_token_the_best_of_its_top(app, sdk):
    asked = dict(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=True, top_logprobs=TOP)
    whole = ask(sdk, **asked)
    chunks = list(ask(sdk, stream=True, **asked))
    tokens = reference_tokens(app, [Message("user", [QUESTION])])
    entries = whole.choices[0].logprobs.content
    assert_the_models_logprobs(app, entries, tokens, model_logprobs(app, [Message("user", [QUESTION])], tokens))
    assert whole.usage.completion_tokens == len(entries)
    assert all(entry.logprob == max(top.logprob for top in entry.top_logprobs) for entry in entries)
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in streamed] == [entry.token for entry in entries]
    assert [entry.logprob for entry in streamed] == pytest.approx([entry.logprob for entry in entries], abs=CLOSE)
    assert ([[top.logprob for top in entry.top_logprobs] for entry in streamed]
            == [pytest.approx([top.logprob for top in entry.top_logprobs], abs=CLOSE) for entry in entries])


def test_a_sampled_replys_logprobs_through_the_python_api_are_the_models_before_temperature_and_top_k(app):
    reply = app.session().send(QUESTION, max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=3, seed=11, logprobs=TOP)
    entries = [entry for event in reply if isinstance(event, TextDelta) for entry in event.logprobs]
    tokens = reply.result().token_ids
    assert_the_models_logprobs(app, entries, tokens, model_logprobs(app, [Message("user", [QUESTION])], tokens))
    assert any(entry.logprob < entry.top[0].logprob for entry in entries)  # some token drawn was not the best


def test_logprobs_without_top_logprobs_give_each_tokens_alone_and_a_reply_that_did_not_ask_gets_none(sdk):
    asked = ask(sdk, max_tokens=4, logprobs=True).choices[0].logprobs.content
    assert len(asked) == 4 and all(entry.top_logprobs == [] for entry in asked)
    assert ask(sdk, max_tokens=4).choices[0].logprobs is None


class Scripted:
    """A backend whose every reply is `events`."""

    def __init__(self, info, events: list) -> None:
        self.info, self._events = info, events

    def send(self, *request: object) -> "Scripted":
        return self

    def events(self) -> Iterator:
        yield from self._events

    def cancel(self) -> None:
        pass


def scripted_entry(token: str) -> TokenLogprob:
    return TokenLogprob(token, -1.0, token.encode())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_keeps_the_logprobs_of_the_tokens_whose_text_was_sent_and_no_others(app, sdk, monkeypatch,
                                                                                         stream):
    # Cut at "o w": "Hell" is sent, so the tokens "l", "o w" and "o" of the second piece are, in part.
    pieces = [TextDelta("Hel", (scripted_entry("Hel"),)),
              TextDelta("lo wo", (scripted_entry("l"), scripted_entry("o w"), scripted_entry("o"))),
              TextDelta("rld", (scripted_entry("rld"),)),
              Finished("Hello world", [1, 2, 3, 4, 5], "end_of_turn", TokenCounts(9, 9, 0, 0, 5), Timings(0, 0, 0),
                       1, ContextUse(64, 48))]
    monkeypatch.setattr(app, "backend", Scripted(app.backend.info, pieces))
    answer = ask(sdk, stop=["o w"], logprobs=True, stream=stream)
    if stream:
        choices = [chunk.choices[0] for chunk in answer if chunk.choices]
        text = "".join(choice.delta.content or "" for choice in choices)
        tokens = [entry.token for choice in choices if choice.logprobs for entry in choice.logprobs.content]
    else:
        text = answer.choices[0].message.content
        tokens = [entry.token for entry in answer.choices[0].logprobs.content]
    assert (text, tokens) == ("Hell", ["Hel", "l", "o w", "o"])


# Request fields -----------------------------------------------------------------------------------


# (what the request adds, the field refused, words of why)
REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format", "JSON replies"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}}}, "response_format",
     "JSON replies"),
    ({"tool_choice": "required"}, "tool_choice", NO_TOOLS),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice", NO_TOOLS),
    ({"functions": [{"name": "weather"}]}, "functions", FUNCTIONS),
    ({"function_call": {"name": "weather"}}, "function_call", FUNCTIONS),
    ({"n": 2}, "n", "one reply per request"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "repetition_penalty"),
    ({"presence_penalty": -1.0}, "presence_penalty", "repetition_penalty"),
    ({"logit_bias": {"42": 100}}, "logit_bias", "not supported"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "max_reasoning_tokens"),
    ({"verbosity": "low"}, "verbosity", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "does not search the web"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "no moderation"),
    ({"store": True}, "store", "stores no completions"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"min_p": 0.1}, "min_p", "does not know this field"),
    ({"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}, "messages[0].name", "no place for"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": "audio_1"}},
                   {"role": "user", "content": "And?"}]}, "messages[1].audio", "keeps no audio"),
]


@pytest.mark.parametrize(("fields", "field", "why"), REFUSED, ids=[field for _, field, _ in REFUSED])
def test_a_field_asking_for_what_the_server_does_not_do_is_400_naming_it_and_the_next_request_is_served(
        sdk, fields, field, why):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="demo", messages=body.pop("messages"), extra_body=body)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == field
    assert error["message"].startswith(f"{field}: ") and why in error["message"]
    assert ask(sdk, "Hi", max_tokens=1).choices[0].message.content is not None


def test_fields_that_by_their_definition_leave_the_reply_as_it_is_are_accepted_and_change_nothing(sdk):
    harmless = {
        "user": "u-1", "safety_identifier": "s-1", "metadata": {"purpose": "test"}, "store": False,
        "prompt_cache_key": "chat-1", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
        "service_tier": "flex", "prediction": {"type": "content", "content": "The sea"},
        "parallel_tool_calls": False, "tool_choice": "none", "function_call": "auto", "tools": [],
        "response_format": {"type": "text"}, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
        "n": 1,
    }
    part = {"type": "text", "text": QUESTION, "prompt_cache_breakpoint": {"mode": "explicit"}}
    plain = ask(sdk, max_tokens=8, temperature=0.0)
    told = ask(sdk, [part], max_tokens=8, temperature=0.0, extra_body=harmless)
    assert told.choices[0].message.content == plain.choices[0].message.content
    assert told.usage.completion_tokens == plain.usage.completion_tokens
