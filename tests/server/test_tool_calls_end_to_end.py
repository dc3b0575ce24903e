"""Tool calls end to end on the demo model: its replies are forced to a call's tokens (forced_replies.py,
a test-only logits processor on the engine's sampler), and the engine, its detokenizer, the call
reader, the chat API's routes (in this process, under the official `openai` client) and the Python
API turn them into calls. Forced text comes out of the engine as raw text: only the reading of calls
makes it a call. The demo's tokenizer has a token for every line break alone; where a checkpoint's
token holds text and its line break together, the reading of calls is tested on such pieces."""

import json

import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from forced_replies import forced_replies
from omni_local.protocol.events import ContextUse, Finished, TextDelta, Timings, TokenCounts
from omni_local.protocol.functions import Tool, ToolCall
from omni_local.protocol.tool_calls import read_tool_calls
from omni_local.protocol.tools import REQUIRED_PREFIX, ToolUse, named_prefix
from omni_local.server.routes import api_mount

END = "<|im_end|>"
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SUNNY = "It is sunny."
WEATHER = Tool("get_weather", "The weather in a city, now.",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
WEATHER_TOOL = {"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                                 "parameters": WEATHER.parameters}}
QUESTION = {"role": "user", "content": "Weather in Paris?"}


def client_of(app) -> openai.OpenAI:
    """The official client on the server's routes over `app`, in this process."""
    http = TestClient(Starlette(routes=[api_mount(app, None)]))
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def sdk(app) -> openai.OpenAI:
    return client_of(app)


@pytest.fixture
def forcing(app):
    """`forcing(*replies)`: the app's next replies are these texts (forced_replies.py)."""
    return lambda *replies: forced_replies(app.backend.engine, app.backend.loaded.processor.tokenizer, *replies)


def ask(sdk: openai.OpenAI, messages: list[dict] | None = None, **fields):
    fields = {"max_tokens": 128, **fields}  # room for the calls forced (the demo's tokens are short)
    return sdk.chat.completions.create(model="demo", messages=messages or [QUESTION], tools=[WEATHER_TOOL], **fields)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def test_a_reply_forced_to_a_call_is_message_tool_calls_with_no_content_and_finish_reason_tool_calls(sdk, forcing):
    with forcing(PARIS + END):
        choice = ask(sdk).choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    assert choice.message.content is None and choice.finish_reason == "tool_calls"


def streamed(chunks) -> tuple[str, list[tuple[str, str, dict]]]:
    """A stream's content, and the calls its `delta.tool_calls` add up to, by index: each call's id and
    name from its first piece, its arguments' JSON text from all of them."""
    pieces = [piece for chunk in chunks for piece in chunk.choices[0].delta.tool_calls or []]
    firsts = {piece.index: piece for piece in reversed(pieces)}
    calls = [(firsts[index].id, firsts[index].function.name,
              json.loads("".join(piece.function.arguments or "" for piece in pieces if piece.index == index)))
             for index in sorted(firsts)]
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks), calls


def test_a_streamed_reply_forced_to_a_call_sends_delta_tool_calls_that_add_up_to_the_call(sdk, forcing):
    with forcing(PARIS + END):
        chunks = [chunk for chunk in ask(sdk, stream=True) if chunk.choices]
    content, calls = streamed(chunks)
    assert [call[1:] for call in calls] == [("get_weather", {"city": "Paris"})] and calls[0][0].startswith("call_")
    assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_text_then_two_calls_streamed_are_the_text_as_content_and_the_calls_in_order_or_the_first_alone(
        sdk, forcing, parallel):
    rome = PARIS.replace("Paris", "Rome")
    with forcing(f"Let me check.\n{PARIS}\n{rome}{END}"):
        chunks = [chunk for chunk in ask(sdk, stream=True, parallel_tool_calls=parallel) if chunk.choices]
    content, calls = streamed(chunks)
    assert [call[1:] for call in calls] == [("get_weather", {"city": "Paris"}),
                                            ("get_weather", {"city": "Rome"})][:2 if parallel else 1]
    assert content == "Let me check." and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_log_probabilities_of_a_reply_with_a_call_are_its_contents_tokens_alone(sdk, forcing):
    with forcing(f"Let me check.\n{PARIS}\nDone.{END}"):
        choice = ask(sdk, logprobs=True).choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.content == "Let me check.\n\nDone."
    assert "".join(token.token for token in choice.logprobs.content) == choice.message.content


def test_a_call_and_its_result_sent_back_are_in_the_prompt_as_the_model_wrote_them_and_are_answered(
        sdk, forcing, app):
    said = f"Let me check.\n{PARIS}"
    with forcing(said + END, SUNNY + END) as prompts:
        called = ask(sdk).choices[0].message
        result = {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "18 C, sunny"}
        answer = ask(sdk, [QUESTION, called.model_dump(exclude_none=True), result]).choices[0]
    assert called.content == "Let me check." and calls_of(called) == [("get_weather", {"city": "Paris"})]
    assert answer.message.content == SUNNY and answer.message.tool_calls is None
    assert answer.finish_reason == "stop"
    prompt = app.backend.loaded.processor.tokenizer.decode(prompts[-1])
    assert prompt.endswith(f"<|im_start|>assistant\n{said}{END}\n<|im_start|>user\n"
                           f"<tool_response>\n18 C, sunny\n</tool_response>{END}\n<|im_start|>assistant\n")


def test_a_forced_call_with_bad_json_is_the_replys_text_and_the_next_call_is_read_again(sdk, forcing):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    with forcing(broken + END, PARIS + END):
        choice = ask(sdk).choices[0]
        after = ask(sdk).choices[0]
    assert choice.message.content == broken and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert calls_of(after.message) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(("tool_choice", "opening"), [
    ("required", REQUIRED_PREFIX),
    ({"type": "function", "function": {"name": "get_weather"}}, named_prefix("get_weather")),
], ids=["required", "named"])
def test_a_call_the_prompt_began_and_the_reply_continued_is_read(sdk, forcing, app, tool_choice, opening):
    with forcing(PARIS.removeprefix(opening) + END) as prompts:
        choice = ask(sdk, tool_choice=tool_choice).choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    prompt = app.backend.loaded.processor.tokenizer.decode(prompts[0])
    assert prompt.endswith(f"<|im_start|>assistant\n{opening}")  # the reply's tokens were the rest alone


def test_a_spoken_reply_with_a_call_has_the_audio_of_its_text_before_the_call_and_the_call(speaking_app):
    # Seeded, the Talker's draws are the same for the same text: the reply without the call says the same.
    spoken = {"modalities": ["text", "audio"], "audio": {"voice": "chelsie", "format": "pcm16"}, "seed": 5}
    sdk = client_of(speaking_app)
    with forced_replies(speaking_app.backend.engine, speaking_app.backend.loaded.processor.tokenizer,
                        f"I will check. {PARIS}{END}", f"I will check. {END}", PARIS + END):
        called = ask(sdk, **spoken).choices[0]
        alone = ask(sdk, **spoken).choices[0]
        call_alone = ask(sdk, **spoken).choices[0]
    assert calls_of(called.message) == calls_of(call_alone.message) == [("get_weather", {"city": "Paris"})]
    assert called.finish_reason == "tool_calls" and called.message.audio.transcript == "I will check."
    assert called.message.audio.data == alone.message.audio.data and len(called.message.audio.data) > 0
    assert call_alone.message.audio is None and call_alone.message.content is None


def test_a_call_cut_short_by_max_tokens_is_the_text_it_had_reached_with_finish_reason_length(sdk, forcing):
    with forcing(PARIS + END):
        choice = ask(sdk, max_tokens=20).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content.startswith("<tool_call>") and PARIS.startswith(choice.message.content)


def test_the_python_api_gets_the_forced_call_on_finished_and_an_answer_to_its_result(app, forcing):
    chat = app.session()
    with forcing(PARIS + END, SUNNY + END):
        reply = chat.send("Weather in Paris?", tools=[WEATHER], max_new_tokens=128)
        events = list(reply)
        called = reply.result()
        answer = chat.send(tool_results={called.tool_calls[0].id: "18 C, sunny"}, tools=[WEATHER],
                           max_new_tokens=128).result()
    assert [(call.name, json.loads(call.arguments)) for call in called.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert called.text == "" and called.stop_reason == "end_of_turn"
    assert [event for event in events if isinstance(event, ToolCall)] == list(called.tool_calls)
    assert answer.text == SUNNY and answer.tool_calls == ()
    assert [message.role for message in chat.history] == ["user", "assistant", "tool", "assistant"]


def test_a_thinking_checkpoints_call_is_read_from_its_answer_and_a_call_in_its_reasoning_stays_reasoning(thinking):
    tokenizer = thinking.backend.loaded.processor.tokenizer
    with forced_replies(thinking.backend.engine, tokenizer, f"I could call {PARIS} now.\n</think>\n\n{PARIS}{END}"):
        reply = thinking.session().send("Weather in Paris?", tools=[WEATHER], max_new_tokens=256).result()
    assert reply.reasoning.startswith(f"I could call {PARIS} now.")
    assert [(call.name, json.loads(call.arguments)) for call in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert reply.text == ""


@pytest.mark.parametrize("pieces", [["Let me check.\n", PARIS], ["Let me check.", "\n", PARIS]],
                         ids=["one token holds the line break", "a token of its own"])
def test_text_before_a_call_ends_without_the_line_break_the_template_puts_back_however_its_tokens_fall(pieces):
    final = Finished("".join(pieces), [1, 2], "end_of_turn", TokenCounts(9, 2, 0, 0, 2), Timings(0, 0, 0), 1,
                     ContextUse(64, 11))
    *_, read = read_tool_calls(iter([*map(TextDelta, pieces), final]), ToolUse((WEATHER,)))
    assert read.text == "Let me check." and [call.name for call in read.tool_calls] == ["get_weather"]
