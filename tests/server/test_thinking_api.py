"""A Thinking checkpoint over the API: the server streams its reasoning as `reasoning_content`
before the answer's `content`, takes it back in an assistant message to continue the session, and
the remote backend reads it into the same events and history as the engine in this process makes."""

import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from served_api import served_api
from omni_local.api import OmniLocal, ReasoningDelta, TextDelta
from omni_local.backends.remote.backend import server_info
from omni_local.server.routes import api_mount

QUESTION = "Tell me a story about a lighthouse keeper."
TOKENS = 16
LIMIT = 6  # reasoning tokens


@pytest.fixture(scope="module")
def api(thinking) -> openai.OpenAI:
    http = TestClient(Starlette(routes=[api_mount(thinking, None)]))
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


def _ask(api: openai.OpenAI, messages: list[dict], **fields):
    return api.chat.completions.create(model="thinking", messages=messages, max_tokens=TOKENS,
                                       extra_body={"max_reasoning_tokens": LIMIT}, **fields)


def test_the_model_list_says_it_is_a_thinking_checkpoint(api):
    (model,) = api.models.list().data
    assert model.model_extra["omni_local"]["kind"] == "thinking"


def test_the_reasoning_streams_as_reasoning_content_before_the_answer_and_equals_the_whole_reply(api):
    messages = [{"role": "user", "content": QUESTION}]
    pieces = [(chunk.choices[0].delta.model_extra.get("reasoning_content"), chunk.choices[0].delta.content)
              for chunk in _ask(api, messages, stream=True) if chunk.choices]
    reasoning = "".join(r for r, _ in pieces if r)
    answer = "".join(c for _, c in pieces if c)
    whole = _ask(api, messages).choices[0].message
    assert reasoning and reasoning == whole.model_extra["reasoning_content"] and answer == whole.content
    kinds = ["reasoning" if r else "answer" for r, c in pieces if r or c]
    assert kinds == sorted(kinds, key=lambda kind: kind == "answer")


def test_a_reply_sent_back_with_its_reasoning_continues_its_session(api):
    messages = [{"role": "user", "content": QUESTION}]
    first = _ask(api, messages)
    reply = first.choices[0].message
    messages += [{"role": "assistant", "content": reply.content,
                  "reasoning_content": reply.model_extra["reasoning_content"]},
                 {"role": "user", "content": "And then?"}]
    second = _ask(api, messages)
    # All of turn one's prompt but the "<think>\n" its reply followed, which turn two's leaves out.
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 2


def test_reasoning_content_on_a_users_message_is_refused(api):
    with pytest.raises(openai.BadRequestError, match="only an assistant message may hold reasoning_content"):
        _ask(api, [{"role": "user", "content": QUESTION, "reasoning_content": "no"}])


def test_the_remote_backend_reads_the_reasoning_as_the_engine_here_makes_it(
        thinking, demo_settings, thinking_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking_server")
    with served_api(demo_settings, root, "--model", str(thinking_checkpoint)) as served:
        settings = demo_settings.replace(backend="openai", backend_url=served.url, cache_dir=str(root / "client"))
        with OmniLocal(settings) as remote:
            assert remote.info.kind == "thinking"
            there, here = remote.session(), thinking.session()
            previous = None
            for question in (QUESTION, "And then?"):
                reply = there.send(question, max_new_tokens=TOKENS, max_reasoning_tokens=LIMIT)
                events = list(reply)
                final = reply.result()
                near = here.send(question, max_new_tokens=TOKENS, max_reasoning_tokens=LIMIT).result()
                assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == final.reasoning
                assert "".join(e.text for e in events if isinstance(e, TextDelta)) == final.text
                assert (final.reasoning, final.text) == (near.reasoning, near.text)
                assert there.history[-1].reasoning == final.reasoning
                if previous is not None:  # the server kept turn one's prompt but the "<think>\n" it ended in
                    assert final.tokens.reused == previous.tokens.prompt - 2
                previous = final


def test_a_servers_model_entry_says_which_member_the_remote_backend_serves(demo_settings):
    entry = {"id": "captioner", "max_model_len": 1024}
    info = server_info(entry, {"kind": "captioner", "speech": False}, "http://127.0.0.1:9/v1", demo_settings)
    unknown = server_info(entry, {"kind": "a new one"}, "http://127.0.0.1:9/v1", demo_settings)
    assert (info.kind, unknown.kind) == ("captioner", "instruct")
