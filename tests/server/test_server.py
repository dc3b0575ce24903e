"""The OpenAI-compatible API as its clients meet it: `python -m omni_local serve` in a subprocess on
the demo model, driven by the official `openai` package (and by plain HTTP where a client would not
send what is tested).

One server for most of the file (speech on, a key, a small upload limit), and one that holds a
single request, for the queue's bound and for clients that leave.
"""

import base64
import io
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError

from api_requests import LONG_SYSTEM_PROMPT, SHORT, ask, data_url_part, image_part, png, private_file
from bad_files import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS
from samples import SPEECH, TYPED_CONTROL_TOKENS, video_file
from served_api import client, served_api
from served_app import REPO, served_app

KEY = "test-key-7f3a"
MAX_UPLOAD_BYTES = 200_000
LONG_QUESTION = "Hello."  # the demo's greedy reply to it runs past 900 tokens, about 4 s here


@pytest.fixture(scope="module")
def server(demo_settings, demo_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("served_api")
    key_file = private_file(root / "key", KEY + "\n")
    with served_api(demo_settings, root, "--speech", "true", "--max-speech-seconds", "1", "--api-key-file",
                    str(key_file), "--max-upload-bytes", str(MAX_UPLOAD_BYTES), "--max-image-pixels",
                    str(MAX_IMAGE_PIXELS), "--max-audio-seconds", str(MAX_AUDIO_SECONDS), key=KEY) as served:
        yield served


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return client(server.url, KEY)


@pytest.fixture(scope="module")
def one_at_a_time(demo_settings, demo_checkpoint, tmp_path_factory):
    """A server that holds one request at a time, with no key, that reads files on this machine."""
    with served_api(demo_settings, tmp_path_factory.mktemp("served_api_one"), "--api-max-requests", "1",
                    "--api-local-files", "true") as served:
        yield served


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def wav(samples: np.ndarray) -> bytes:
    file = io.BytesIO()
    soundfile.write(file, samples, 16_000, format="WAV")
    return file.getvalue()


def streamed(api: openai.OpenAI, content, **fields) -> list:
    return list(ask(api, content, stream=True, **fields))


def reused_whole(before) -> int:
    """The cached tokens of the turn after `before` that reuses all of it: its prompt and reply, but
    for a reply cut at its length the last token, which was never read (so has no KV)."""
    return before.usage.total_tokens - (before.choices[0].finish_reason == "length")


def audio_deltas(chunks: list, key: str) -> list[str]:
    """The `delta.audio[key]` pieces of a spoken stream (the SDK keeps delta.audio as an extra field)."""
    deltas = [getattr(c.choices[0].delta, "audio", None) for c in chunks if c.choices]
    return [d[key] for d in deltas if d and key in d]


# Replies ------------------------------------------------------------------------------------------


def test_a_streamed_reply_comes_in_pieces_and_says_what_the_whole_reply_says(api):
    chunks = streamed(api, "Tell me about the sea.", stream_options={"include_usage": True})
    whole = ask(api, "Tell me about the sea.")
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    ending, last = chunks[-2], chunks[-1]
    assert ending.choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert ending.omni_local["tokens"]["generated"] == SHORT and ending.omni_local["stop_reason"] == "max_new_tokens"
    assert last.choices == [] and last.usage.completion_tokens == SHORT
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens == ending.omni_local["tokens"]["prompt"]


def test_a_spoken_stream_sends_pcm16_that_adds_up_to_the_reported_audio(api):
    chunks = streamed(api, "Say hello.", modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"})
    samples = np.concatenate([np.frombuffer(base64.b64decode(d), "<i2") for d in audio_deltas(chunks, "data")])
    speech = chunks[-1].omni_local["speech"]
    assert speech["voice"] == "Chelsie" and len(samples) == round(speech["audio_s"] * 24_000) > 0
    assert "".join(audio_deltas(chunks, "transcript"))
    assert len(set(audio_deltas(chunks, "id"))) == 1  # one audio id for the whole reply


def test_a_spoken_reply_not_streamed_is_a_wav_file_of_the_reported_audio_with_its_transcript(api):
    reply = ask(api, "Say hello.", modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    message = reply.choices[0].message
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    assert rate == 24_000 and len(samples) == round(reply.omni_local["speech"]["audio_s"] * 24_000) > 0
    assert message.content is None and message.audio.transcript and message.audio.id.startswith("audio_")


def test_streamed_audio_must_be_pcm16(api):
    with pytest.raises(openai.BadRequestError, match="streamed audio is pcm16"):
        ask(api, "Hi", stream=True, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})


def test_a_reply_is_cut_before_its_first_stop_string_and_ends_as_stopped(api):
    question = "Tell me about the sea."
    text = ask(api, question, max_tokens=24).choices[0].message.content
    stop = text[len(text) // 2:][:3]
    cut = text[:text.index(stop)]
    whole = ask(api, question, max_tokens=24, stop=[stop, "never said"])
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    chunks = streamed(api, question, max_tokens=24, stop=stop)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].omni_local["stop_reason"] == "cancelled"


@pytest.mark.parametrize("media", ["none", "image and audio", pytest.param("video", marks=pytest.mark.torchvision)])
def test_a_question_through_the_api_is_answered_as_through_the_python_api(api, app, media):
    image, sound, video = png(1), wav(SPEECH[:16_000]), video_file(3)
    parts, files = {
        "none": ([], {}),
        "image and audio": ([image_part(image), audio_part(sound)], {"images": [image], "audio": [sound]}),
        "video": ([data_url_part("video_url", "video/mp4", video)], {"videos": [video]}),
    }[media]
    reply = ask(api, [*parts, {"type": "text", "text": "What is this?"}], max_tokens=16)
    local = app.session().send("What is this?", max_new_tokens=16, **files).result()
    assert reply.choices[0].message.content == local.text
    assert reply.usage.prompt_tokens == local.tokens.prompt
    counts = reply.omni_local["media"]
    assert counts["encoded"] + counts["from_cache"] + counts["in_kv"] == len(parts)


def test_a_file_on_the_server_is_read_where_api_local_files_allows_it(one_at_a_time, tmp_path):
    (tmp_path / "picture.png").write_bytes(png(4))
    part = {"type": "image_url", "image_url": {"url": (tmp_path / "picture.png").as_uri()}}
    reply = ask(client(one_at_a_time.url), [part, {"type": "text", "text": "What is this?"}], max_tokens=1)
    assert reply.omni_local["media"]["encoded"] == 1


def test_a_typed_control_token_is_plain_text(api, template_ids):
    reply = ask(api, TYPED_CONTROL_TOKENS, system="Be brief.", max_tokens=1)
    assert reply.usage.prompt_tokens == len(template_ids("Be brief.", TYPED_CONTROL_TOKENS))


# The prefix cache, through a stateless API --------------------------------------------------------


def test_the_same_long_system_prompt_sent_twice_is_read_from_the_cache_the_second_time(server):
    system = f"{uuid.uuid4().hex}. {LONG_SYSTEM_PROMPT}"  # new to the cache
    first = ask(client(server.url, KEY), "What is the time?", system=system)
    second = ask(client(server.url, KEY), "Where are we?", system=system)  # another client
    assert first.usage.prompt_tokens > 300
    assert first.usage.prompt_tokens_details.cached_tokens < 10  # the template's opening, at most
    assert second.usage.prompt_tokens_details.cached_tokens > 300


def test_each_turn_of_a_conversation_reuses_the_whole_of_the_turn_before_its_reply_included(api):
    messages = [{"role": "system", "content": uuid.uuid4().hex}, {"role": "user", "content": "Hello."}]
    before = None
    for question in ("And then?", "Why?", "Thanks."):
        reply = api.chat.completions.create(model="demo", messages=messages, max_tokens=SHORT)
        if before is not None:
            assert reply.usage.prompt_tokens_details.cached_tokens == reused_whole(before)
        before = reply
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": question}]


def test_eight_clients_of_ten_turns_each_are_all_answered_each_turn_reusing_the_last(server):
    def converse(seat: int) -> list[int]:
        api = client(server.url, KEY)
        messages, missed = [{"role": "user", "content": f"Client {seat} says hello."}], []
        before = None
        for turn in range(10):
            reply = api.chat.completions.create(model="demo", messages=messages, max_tokens=8)
            if before is not None:
                missed.append(reused_whole(before) - reply.usage.prompt_tokens_details.cached_tokens)
            before = reply
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"Client {seat}, turn {turn}: go on."}]
        return missed

    with ThreadPoolExecutor(8) as pool:
        missed = list(pool.map(converse, range(8)))  # re-raises any client's failure
    assert missed == [[0] * 9] * 8


# Refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "fields", "message"), [
    ([image_part(png(0)[:200])], {}, r"messages\[0\]\.content\[0\]: the file is truncated or corrupt"),
    ("Hi", {"modalities": ["text", "audio"], "audio": {"voice": "Nobody", "format": "wav"}}, "unknown voice 'Nobody'"),
    ("word " * 1200, {}, r"over the limit of 960 \(max_prompt_tokens\)"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], {}, "does not fetch URLs"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], {}, "api_local_files = false"),
    ("Hi", {"temperature": -1.0}, "temperature must be 0"),
    ("Hi", {"extra_body": {"top_k": "many"}}, r"top_k: Input should be a valid integer"),
    ("Hi", {"response_format": {"type": "json_object"}}, r"response_format: JSON replies .* are not supported"),
    ("Hi", {"tool_choice": "required"}, r"tool_choice: a call is required, but no tools are given"),
    ("Hi", {"extra_body": {"min_p": 0.1}}, r"min_p: this server does not know this field"),
], ids=["bad image", "unknown voice", "over-long prompt", "http url", "file url", "bad temperature", "bad type",
        "json reply", "tools", "unknown field"])
def test_bad_input_is_an_error_object_with_400_saying_what_is_wrong_and_the_next_request_is_served(
        api, content, fields, message):
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        ask(api, content, **fields)
    assert refused.value.status_code == 400 and refused.value.body["type"] == "invalid_request_error"
    assert ask(api, "Hi", max_tokens=1).choices[0].message.content is not None


def test_an_image_over_the_upload_limit_is_413_and_so_is_a_body_over_its_bound(api):
    noise = png(2, (300, 300))  # random pixels do not compress: about 270 KB
    assert MAX_UPLOAD_BYTES < len(noise) < 2 * MAX_UPLOAD_BYTES
    with pytest.raises(openai.APIStatusError, match="over the upload limit") as refused:
        ask(api, [image_part(noise)])
    assert refused.value.status_code == 413
    with pytest.raises(openai.APIStatusError, match="the request body is .* over the limit") as refused:
        ask(api, [image_part(noise)] * 4)
    assert refused.value.status_code == 413


def test_a_body_sent_in_chunks_is_413_once_it_passes_its_bound(server):
    def pieces():  # no Content-Length: the bound is checked as the body comes
        for _ in range(5):
            yield b" " * MAX_UPLOAD_BYTES

    refused = httpx.post(f"{server.url}/chat/completions", content=pieces(), timeout=30,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"


def test_another_model_is_404_model_not_found(api):
    with pytest.raises(openai.NotFoundError) as refused:
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.code == "model_not_found" and "serves 'demo'" in refused.value.message


@pytest.mark.parametrize("key", [None, "wrong"])
def test_a_missing_or_wrong_key_is_401(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.get(f"{server.url}/models", headers=headers)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    if key:
        with pytest.raises(openai.AuthenticationError):
            ask(client(server.url, key), "Hi")


def test_a_streamed_reply_with_logprobs_carries_each_tokens_in_its_chunks_the_greedy_one_the_best(api):
    chunks = streamed(api, "Tell me about the sea.", temperature=0.0, logprobs=True, top_logprobs=3,
                      stream_options={"include_usage": True})
    entries = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == SHORT
    assert all(len(e.top_logprobs) == 3 and e.logprob == e.top_logprobs[0].logprob for e in entries)


def test_a_request_past_the_bound_is_refused_at_once_with_429(one_at_a_time):
    api = client(one_at_a_time.url)
    with ask(api, LONG_QUESTION, max_tokens=900, stream=True) as held:
        next(iter(held))
        began = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="api_max_requests") as refused:
            ask(api, "Hi", max_tokens=1)
        assert time.monotonic() - began < 1.0 and refused.value.response.headers["retry-after"] == "1"
    _until_served(api)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_stops_its_reply_in_the_engine(one_at_a_time, stream):
    def leave_after(seconds: float) -> None:
        api = client(one_at_a_time.url, timeout=seconds)
        if stream:
            with ask(api, LONG_QUESTION, max_tokens=900, stream=True) as reply:
                next(iter(reply))
                time.sleep(seconds)
        else:
            with pytest.raises(openai.APITimeoutError):  # the client gives up and closes the connection
                ask(api, LONG_QUESTION, max_tokens=900)

    with ThreadPoolExecutor(1) as pool:
        leaving = pool.submit(leave_after, 1.5)
        time.sleep(0.5)
        working = _cpu_seconds_in(one_at_a_time, 0.8)
        leaving.result()
    time.sleep(0.3)
    assert _cpu_seconds_in(one_at_a_time, 0.8) < working / 4
    _until_served(client(one_at_a_time.url))


def _cpu_seconds_in(served, seconds: float) -> float:
    used = served.cpu_seconds()
    time.sleep(seconds)
    return served.cpu_seconds() - used


def _until_served(api: openai.OpenAI) -> None:
    """The server holds the request that ended for a moment after its client saw it end."""
    deadline = time.monotonic() + 5
    while True:
        try:
            ask(api, "Hi", max_tokens=1)
            return
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# Stopping the server -----------------------------------------------------------------------------


def stopped_while_streaming(demo_settings, root, grace_s: float, max_tokens: int,
                            spoken: bool = False) -> tuple[list, Exception | None]:
    """A stream's chunks, and what the client raised, when the server is sent SIGTERM after its first
    chunk with `shutdown_grace_s` of `grace_s`; the server must then exit, as uvicorn does, by the signal."""
    chunks, raised = [], None
    speech = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"}} if spoken else {}
    with served_api(demo_settings, root, "--shutdown-grace-s", str(grace_s), "--speech", str(spoken).lower()) as served:
        with ask(client(served.url), LONG_QUESTION, max_tokens=max_tokens, stream=True, **speech) as reply:
            stream = iter(reply)
            chunks.append(next(stream))
            served.process.send_signal(signal.SIGTERM)
            try:
                chunks.extend(stream)
            except openai.APIError as error:
                raised = error
        assert served.process.wait(timeout=60) == -signal.SIGTERM
    return chunks, raised


@pytest.mark.parametrize("spoken", [False, True], ids=["text", "spoken"])
def test_a_stream_longer_than_the_shutdown_grace_ends_with_a_finish_reason_and_an_error_the_client_raises(
        demo_settings, demo_checkpoint, tmp_path, spoken):
    chunks, raised = stopped_while_streaming(demo_settings, tmp_path, grace_s=0.5, max_tokens=900, spoken=spoken)
    assert isinstance(raised, openai.APIError) and "the server is shutting down" in raised.message
    assert raised.code == "server_shutting_down"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["abort"]
    assert chunks[-1].choices[0].finish_reason == "abort" and len(chunks) < 900


def test_a_stream_that_ends_within_the_shutdown_grace_is_sent_whole(demo_settings, demo_checkpoint, tmp_path):
    chunks, raised = stopped_while_streaming(demo_settings, tmp_path, grace_s=120, max_tokens=60)
    assert raised is None
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].omni_local["tokens"]["generated"] == 60


def test_serve_refuses_to_listen_beyond_this_machine_without_a_key_before_loading_a_model():
    done = subprocess.run([sys.executable, "-m", "omni_local", "serve", "--api-host", "0.0.0.0", "--model",
                           "/nonexistent"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "api_host = '0.0.0.0') needs a key" in done.stderr and "/nonexistent" not in done.stderr


# The models, and the API beside the page ----------------------------------------------------------


def test_the_models_list_names_the_model_served_and_what_it_takes(api, demo_settings):
    [model] = api.models.list().data
    assert model.id == "demo" and model.owned_by == "omni_local" and model.created <= time.time()
    assert model.max_model_len == demo_settings.max_context_tokens
    assert model.omni_local["speech"] is True and "Ethan" in model.omni_local["voices"]
    assert model.omni_local["max_prompt_tokens"] == demo_settings.max_prompt_tokens
    assert api.models.retrieve("demo").id == "demo"


def test_the_page_serves_the_api_beside_it_on_its_port_each_behind_its_own_login(demo_settings, demo_checkpoint,
                                                                                 tmp_path):
    credentials, key_file = private_file(tmp_path / "users", "ada:lovelace\n"), private_file(tmp_path / "key", KEY)
    with served_app(demo_settings, tmp_path, "--ui-serves-api", "true", "--ui-credentials-file", str(credentials),
                    "--api-key-file", str(key_file)) as page:
        api = client(page.url + "v1", KEY)
        assert [m.id for m in api.models.list().data] == ["demo"]
        assert ask(api, "Hi", max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):  # the page's login does not open the API
            client(page.url + "v1", "ada:lovelace").models.list()
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            Client(page.url, verbose=False)  # nor the API's key the page
        Client(page.url, auth=("ada", "lovelace"), verbose=False)


def test_the_page_refuses_to_serve_the_api_beyond_this_machine_without_a_key(tmp_path):
    credentials = private_file(tmp_path / "users", "ada:lovelace\n")
    done = subprocess.run([sys.executable, "app.py", "--ui-host", "0.0.0.0", "--ui-credentials-file", str(credentials),
                           "--ui-serves-api", "true", "--model", "/nonexistent"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ui_host = '0.0.0.0') needs a key" in done.stderr
