"""The remote backend (`backend = "openai"`) against recorded streams of each dialect, through the
same `openai` client code that talks to a real server: replies, requests, figures, errors, cancel."""

import base64
import contextlib
import http.server
import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

from recorded_server import (
    OUR_MODEL, QWEN, URL, USAGE, VLLM_MODEL, HeldStream, RecordedServer, chunk, error_answer, event_stream,
    openai_spoken_stream, pcm16_base64, remote_app, text_stream, tone, vllm_omni_stream,
)
from samples import clip, picture, video_file
from omni_local.api import AudioChunk, Finished, TextDelta
from omni_local.backends.remote import RemoteBackend
from omni_local.errors import MediaError, OmniLocalError, RequestError
from omni_local.media import MediaLimits
from omni_local.media.video import Video, read_video_file
from omni_local.metrics_line import metrics_line
from omni_local.protocol.events import (ContextUse, MediaCounts, SpeechReport, Timings, TokenChoice, TokenCounts,
                                   TokenLogprob)
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.settings import Settings

QUESTION = [Message("user", ["Hi?"])]
GREEDY = SamplingParams(max_new_tokens=32)
# Our server's figures, on the chunk that carries the finish reason.
REPORT = {"stop_reason": "max_new_tokens",
          "tokens": {"prompt": 415, "computed": 35, "reused_gpu": 300, "reused_host": 80, "generated": 32},
          "timings": {"queue_wait_s": 0.002, "ttft_s": 0.017, "decode_tokens_per_s": 142.0}, "seed": 7,
          "context": {"size": 1024, "prompt_limit": 960, "turns_left_out": 1},
          "media": {"in_kv": 1, "from_cache": 0, "encoded": 2}, "speech": None}


def events(backend: RemoteBackend, messages: list[Message] = QUESTION, params: SamplingParams = GREEDY,
           speech: SpeechParams | None = None) -> list:
    return list(backend.send("chat", messages, params, speech).events())


def reply_of(items: list) -> tuple[str, np.ndarray, Finished]:
    text = "".join(e.text for e in items if isinstance(e, TextDelta))
    audio = [e.samples for e in items if isinstance(e, AudioChunk)]
    assert isinstance(items[-1], Finished) and not any(isinstance(e, Finished) for e in items[:-1])
    return text, np.concatenate(audio) if audio else np.zeros(0, np.float32), items[-1]


# Replies


def test_a_text_reply_streams_its_pieces_and_ends_with_one_finished_holding_the_whole_text():
    server = RecordedServer(replies=[text_stream(["Hel", "lo", "!"])])
    items = events(server.backend())
    assert [e.text for e in items if isinstance(e, TextDelta)] == ["Hel", "lo", "!"]
    text, _, final = reply_of(items)
    assert text == final.text == "Hello!"
    assert final.stop_reason == "end_of_turn" and final.token_ids is None


def test_a_reply_cut_by_the_length_limit_says_so():
    server = RecordedServer(replies=[text_stream(["a"], finish="length")])
    assert reply_of(events(server.backend()))[2].stop_reason == "max_new_tokens"


def test_an_openai_dialect_spoken_reply_decodes_each_pcm16_chunk_and_its_transcript_is_the_text():
    pieces = [tone(0.08), tone(0.4), tone(0.8)]
    server = RecordedServer(replies=[openai_spoken_stream(["Hel", "lo"], pieces)])
    items = events(server.backend(), speech=SpeechParams("Ethan"))
    text, audio, final = reply_of(items)
    assert text == "Hello"
    assert [e.samples.size for e in items if isinstance(e, AudioChunk)] == [p.size for p in pieces]
    np.testing.assert_allclose(audio, np.concatenate(pieces), atol=1 / 32767)
    assert all(e.sample_rate == 24_000 and e.samples.dtype == np.float32 for e in items if isinstance(e, AudioChunk))
    assert final.speech.voice == "Ethan" and final.speech.audio_s == pytest.approx(1.28)


def test_a_vllm_omni_spoken_reply_decodes_its_wav_chunks_and_resamples_another_rate_to_24_khz():
    at_16k = [(tone(0.5, 16_000), 16_000), (tone(0.5, 16_000), 16_000)]
    server = RecordedServer(models=[VLLM_MODEL], replies=[vllm_omni_stream(["Hi", " there"], at_16k)])
    text, audio, final = reply_of(events(server.backend(), speech=SpeechParams("Ethan")))
    assert text == "Hi there" and final.stop_reason == "end_of_turn"
    assert abs(audio.size - 24_000) <= 2  # one second, at 24 kHz
    spectrum = np.abs(np.fft.rfft(audio[2_000:-2_000]))
    assert np.fft.rfftfreq(audio.size - 4_000, 1 / 24_000)[spectrum.argmax()] == pytest.approx(220, abs=2)


def test_a_vllm_omni_wav_chunk_at_24_khz_is_its_samples_as_they_are():
    piece = tone(0.3)
    server = RecordedServer(models=[VLLM_MODEL], replies=[vllm_omni_stream(["Hi"], [(piece, 24_000)])])
    _, audio, _ = reply_of(events(server.backend(), speech=SpeechParams("Ethan")))
    np.testing.assert_allclose(audio, piece, atol=1 / 32767)


def test_a_vllm_omni_audio_chunk_of_bare_pcm16_as_asked_for_in_auto_is_decoded_at_24_khz():
    """Asked for "pcm16" (auto names OpenAI's format too), a newer vLLM-Omni sends PCM without a WAV header."""
    piece = tone(0.3)
    stream = vllm_omni_stream(["Hi"], [(piece, 24_000)])
    audio_chunk = next(c for c in stream if c.get("modality") == "audio")
    audio_chunk["choices"][0]["delta"]["content"] = pcm16_base64(piece)
    server = RecordedServer(models=[VLLM_MODEL], replies=[stream])
    _, audio, _ = reply_of(events(server.backend(), speech=SpeechParams("Ethan")))
    np.testing.assert_allclose(audio, piece, atol=1 / 32767)


def test_auto_tells_vllm_omnis_stream_from_its_modality_field_and_its_audio_never_shows_as_text():
    server = RecordedServer(models=[VLLM_MODEL], replies=[vllm_omni_stream(["Hi"], [(tone(0.2), 24_000)])])
    text, audio, _ = reply_of(events(server.backend(backend_dialect="auto"), speech=SpeechParams("Ethan")))
    assert text == "Hi" and audio.size == 4_800


def test_a_dialect_set_in_the_settings_reads_the_stream_its_own_way():
    """Forced to OpenAI's dialect, a chunk's `modality` means nothing: its content is text."""
    server = RecordedServer(models=[VLLM_MODEL], replies=[vllm_omni_stream(["Hi"], [(tone(0.1), 24_000)])])
    text, audio, _ = reply_of(events(server.backend(backend_dialect="openai"), speech=SpeechParams("Ethan")))
    assert text.startswith("Hi") and len(text) > 100 and audio.size == 0  # the WAV file's base64, as text


# Requests


def data_url_bytes(url: str, kind: str) -> bytes:
    head, data = url.split(",", 1)
    assert head == f"data:{kind};base64"
    return base64.b64decode(data)


def test_a_question_keeps_its_parts_in_order_and_sends_each_medium_losslessly():
    image, sound = picture(1), clip(2)
    video = read_video_file(video_file(3), MediaLimits.from_settings(Settings()), name="clip.webm")
    server = RecordedServer(replies=[text_stream(["ok"])])
    events(server.backend(), [Message("user", [image, "Look, and", sound, video, "listen."])])
    content = server.requests[0]["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url", "text", "input_audio", "video_url", "text"]
    assert [content[1]["text"], content[4]["text"]] == ["Look, and", "listen."]
    sent_image = Image.open(io.BytesIO(data_url_bytes(content[0]["image_url"]["url"], "image/png")))
    assert np.array_equal(np.asarray(sent_image), np.asarray(image))
    assert content[2]["input_audio"]["format"] == "wav"
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(content[2]["input_audio"]["data"])), dtype="float32")
    assert rate == 16_000 and np.array_equal(samples, sound)
    assert data_url_bytes(content[3]["video_url"]["url"], "video/webm") == video.data


def test_the_same_image_is_the_same_bytes_at_every_turn_so_a_servers_media_cache_finds_it():
    server = RecordedServer(replies=[text_stream(["a"]), text_stream(["b"])])
    backend = server.backend()
    for _ in range(2):
        events(backend, [Message("user", [picture(4), "What is it?"])])
    first, second = (request["messages"][0]["content"][0] for request in server.requests)
    assert first == second


def test_a_request_streams_with_usage_and_carries_every_sampling_field():
    server = RecordedServer(replies=[text_stream(["a"])])
    params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1, seed=5)
    events(server.backend(), params=params)
    body = server.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "demo" and body["modalities"] == ["text"]
    assert {key: body[key] for key in ("max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k",
                                       "repetition_penalty", "seed")} == \
        {"max_completion_tokens": 64, "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
         "repetition_penalty": 1.1, "seed": 5}
    assert "audio" not in body and "speaker" not in body


def test_no_top_k_limit_and_no_seed_are_left_out_for_the_server_to_spell_its_own_way():
    server = RecordedServer(replies=[text_stream(["a"])])
    events(server.backend(), params=SamplingParams(top_k=0, seed=None))
    assert "top_k" not in server.requests[0] and "seed" not in server.requests[0]


def test_logprobs_asked_for_are_asked_of_the_server_and_its_entries_come_with_the_text_they_make():
    pieces = text_stream(["Hel", "lo"])
    said = {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
            "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
                             {"token": "\u00e9", "logprob": -1.5, "bytes": None}]}
    pieces[1]["choices"][0]["logprobs"] = {"content": [said], "refusal": None}
    pieces[2]["choices"][0]["logprobs"] = {"content": [], "refusal": None}  # its token's text is not all here yet
    server = RecordedServer(replies=[pieces])
    items = events(server.backend(), params=SamplingParams(logprobs=2))
    assert {key: server.requests[0][key] for key in ("logprobs", "top_logprobs")} == {"logprobs": True,
                                                                                     "top_logprobs": 2}
    texts = [event for event in items if isinstance(event, TextDelta)]
    assert texts[0] == TextDelta("Hel", (TokenLogprob("Hel", -0.5, b"Hel", (TokenChoice("Hel", -0.5, b"Hel"),
                                                                             TokenChoice("\u00e9", -1.5, None))),))
    assert texts[1] == TextDelta("lo")


def test_logprobs_asked_of_a_server_that_sends_text_without_them_fail_the_reply_saying_so():
    server = RecordedServer(replies=[text_stream(["Hel", "lo"])])  # each chunk's logprobs null
    with pytest.raises(RequestError, match="the server sent text without logprobs: it does not implement them"):
        events(server.backend(), params=SamplingParams(logprobs=2))


def test_a_request_that_asks_for_no_logprobs_does_not_ask_the_server():
    server = RecordedServer(replies=[text_stream(["a"])])
    events(server.backend())
    assert "logprobs" not in server.requests[0] and "top_logprobs" not in server.requests[0]


OPENAI_VOICE = {"audio": {"voice": "Chelsie", "format": "pcm16"}, "talker_temperature": 0.5}


@pytest.mark.parametrize("dialect, models, expected", [
    ("openai", [VLLM_MODEL], OPENAI_VOICE),
    ("vllm-omni", [VLLM_MODEL], {"speaker": "Chelsie"}),
    ("auto", [VLLM_MODEL], OPENAI_VOICE | {"speaker": "Chelsie"}),
    ("auto", None, OPENAI_VOICE),  # our own server: OpenAI's dialect
])
def test_a_spoken_request_names_its_voice_as_the_servers_dialect_does(dialect, models, expected):
    server = RecordedServer(replies=[openai_spoken_stream(["a"], [tone(0.1)])])
    if models:
        server.models = models
    events(server.backend(backend_dialect=dialect), speech=SpeechParams("Chelsie", temperature=0.5))
    body = server.requests[0]
    assert body["modalities"] == ["text", "audio"]
    assert {key: body[key] for key in ("audio", "speaker", "talker_temperature") if key in body} == expected


def test_a_two_turn_session_sends_the_whole_conversation_each_time(monkeypatch):
    server = RecordedServer(replies=[text_stream(["Hello", " Ada."]), text_stream(["Ada."])])
    with remote_app(monkeypatch, server) as app:
        chat = app.session(system_prompt="Be brief.")
        assert chat.send("I am Ada.").result().text == "Hello Ada."
        chat.send("Who am I?").result()
    assert server.requests[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "I am Ada."}]},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": [{"type": "text", "text": "Who am I?"}]},
    ]


def test_a_decoded_video_is_refused_and_read_video_gives_the_file_to_send(monkeypatch):
    server = RecordedServer(replies=[text_stream(["ok"])])
    video = Video(np.zeros((2, 8, 8, 3), np.uint8), 2.0, None)
    with remote_app(monkeypatch, server) as app:
        with pytest.raises(MediaError, match="remote backend sends a video as its file"):
            app.read_video(video)
        with pytest.raises(MediaError, match="remote backend sends a video as its file"):
            events(app.backend, [Message("user", [video, "What happens?"])])
        read = app.read_video(video_file(5))
        assert read.data == video_file(5) and read.seconds == pytest.approx(2.0, abs=0.2)
        app.session().send("What happens?", videos=[video_file(5)]).result()
    assert server.requests[0]["messages"][0]["content"][0]["type"] == "video_url"


@contextlib.contextmanager
def socket_server(pieces: list[dict], hold: bool = False) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1, its API's URL: each reply streams `pieces`, then ends, or
    (`hold`) sends nothing more while the server thinks on."""
    stop = threading.Event()

    class Answering(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [OUR_MODEL]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = [f"data: {json.dumps(piece)}\n\n".encode() for piece in pieces]
            for event in events if hold else [*events, b"data: [DONE]\n\n", b""]:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            if hold:
                stop.wait(30)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()



# Figures


def test_our_servers_report_fills_the_finished_event():
    server = RecordedServer(replies=[text_stream(["a", "b"], finish="length", omni_local=REPORT)])
    final = reply_of(events(server.backend()))[2]
    assert final.stop_reason == "max_new_tokens" and final.seed == 7
    assert final.tokens == TokenCounts(415, 35, 300, 80, 32)
    assert final.timings == Timings(0.002, 0.017, 142.0)
    assert final.context == ContextUse(1024, 960, 1)
    assert final.media == MediaCounts(in_kv=1, from_cache=0, encoded=2)
    assert final.speech is None


def test_our_servers_speech_report_is_kept_as_it_says():
    speech = {"voice": "Ethan", "frames": 30, "audio_s": 2.4, "first_audio_s": 0.09, "real_time_factor": 0.23,
              "talker_prompt": 120, "talker_reused": 0}
    stream = openai_spoken_stream(["a"], [tone(0.1)], omni_local={**REPORT, "speech": speech})
    final = reply_of(events(RecordedServer(replies=[stream]).backend(), speech=SpeechParams("Ethan")))[2]
    assert final.speech == SpeechReport(**speech)


def test_figures_only_usage_gives_are_taken_from_it_and_the_rest_are_unknown_not_zero():
    server = RecordedServer(models=[VLLM_MODEL], replies=[text_stream(["Hel", "lo"])])
    final = reply_of(events(server.backend()))[2]
    assert final.tokens == TokenCounts(prompt=27, computed=None, reused_gpu=None, reused_host=None, generated=3)
    assert final.timings.queue_wait_s is None and final.timings.ttft_s > 0
    assert final.media is None and final.seed is None and final.context == ContextUse(65536, 49152)
    assert "unknown of 27 prompt tokens from cache" in metrics_line(final)
    assert "3 reply tokens" in metrics_line(final)


def test_cached_tokens_count_as_reused_with_the_split_between_device_and_host_unknown():
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 20}}
    server = RecordedServer(models=[VLLM_MODEL], replies=[text_stream(["a"], usage=usage)])
    final = reply_of(events(server.backend()))[2]
    assert final.tokens == TokenCounts(prompt=27, computed=7, reused_gpu=20, reused_host=None, generated=3)
    assert "20 of 27 prompt tokens from cache · 3 reply tokens" in metrics_line(final)


def test_the_decode_rate_is_measured_here_from_the_reply_tokens_after_the_first():
    def slowly(body):
        def pieces():
            for piece in text_stream(["a", "b", "c"], usage={**USAGE, "completion_tokens": 3}):
                time.sleep(0.05)
                yield piece
        return event_stream(pieces())
    final = reply_of(events(RecordedServer(models=[VLLM_MODEL], replies=[slowly]).backend()))[2]
    # Two tokens after the first, over at least the 0.1 s of sleeps between a and c.
    assert 0 < final.timings.decode_tokens_per_s <= 2 / 0.1 + 0.5


def test_a_spoken_reply_without_our_report_says_its_voice_length_and_first_audio_and_no_more():
    stream = vllm_omni_stream(["Hi"], [(tone(0.5), 24_000)])
    final = reply_of(events(RecordedServer(models=[VLLM_MODEL], replies=[stream]).backend(),
                            speech=SpeechParams("Aiden")))[2]
    assert final.speech.voice == "Aiden" and final.speech.audio_s == pytest.approx(0.5)
    assert final.speech.first_audio_s > 0
    assert (final.speech.frames, final.speech.real_time_factor, final.speech.talker_prompt) == (None, None, None)
    assert "0.5 s of speech (Aiden), first audio" in metrics_line(final)


# The model list


def test_the_servers_model_entry_says_what_the_page_shows_and_allows():
    info = RecordedServer().backend().info
    assert info.model_id == "demo" and info.model == "demo model: random weights, replies are noise"
    assert info.runs_on == f"remote: {URL} (float32 on cpu)"
    assert (info.speech, info.voices, info.video) == (True, ["Ethan"], True)
    assert (info.max_context_tokens, info.max_prompt_tokens, info.concurrency) == (1024, 960, 16)


def test_a_server_without_our_entry_is_taken_to_serve_qwen3_omni_with_its_voices():
    info = RecordedServer(models=[VLLM_MODEL]).backend().info
    assert info.model_id == info.model == QWEN and info.runs_on == f"remote: {URL}"
    assert (info.speech, info.voices, info.video) == (True, ["Aiden", "Chelsie", "Ethan"], True)
    assert (info.max_context_tokens, info.max_prompt_tokens) == (65536, 49152)


def test_a_server_that_gives_no_context_size_is_taken_to_have_the_settings_one():
    bare = {"id": "omni", "object": "model", "created": 0, "owned_by": "someone"}
    info = RecordedServer(models=[bare]).backend(max_context_tokens=4096, max_prompt_tokens=3000).info
    assert (info.max_context_tokens, info.max_prompt_tokens) == (4096, 3000)


def test_backend_model_picks_the_served_model_and_the_first_listed_is_the_default():
    other = {**VLLM_MODEL, "id": "other"}
    server = RecordedServer(models=[other, VLLM_MODEL], replies=[text_stream(["a"])])
    assert server.backend().info.model_id == "other"
    backend = server.backend(backend_model=QWEN)
    events(backend)
    assert backend.info.model_id == QWEN and server.requests[0]["model"] == QWEN


def test_a_model_the_server_does_not_list_is_a_clear_error_naming_those_it_does():
    with pytest.raises(OmniLocalError, match="does not serve 'qwen' \\(backend_model\\); it serves demo"):
        RecordedServer().backend(backend_model="qwen")


# Errors


def test_a_bad_request_is_a_request_error_with_the_servers_own_message():
    server = RecordedServer(replies=[error_answer(400, "unknown voice 'Bob': this model speaks as Ethan")])
    with pytest.raises(RequestError) as raised:
        events(server.backend(), speech=SpeechParams("Bob"))
    assert str(raised.value) == "unknown voice 'Bob': this model speaks as Ethan"


@pytest.mark.parametrize("status", [429, 503])
def test_a_full_queue_is_said_to_be_a_busy_server_at_once_with_no_retry(status):
    server = RecordedServer(replies=[error_answer(status, "the queue is full (32 requests)")])
    with pytest.raises(RequestError, match=f"the server at {URL} is busy, try again in a moment"):
        events(server.backend())
    assert len(server.requests) == 1


def test_an_error_event_in_the_middle_of_the_stream_is_a_request_error():
    failing = [chunk({"content": "Hel"}), {"error": {"message": "the engine ran out of memory", "code": 500}}]
    server = RecordedServer(replies=[failing])
    with pytest.raises(RequestError, match="failed while replying: the engine ran out of memory"):
        events(server.backend())


def test_vllms_older_error_event_is_a_request_error_too():
    failing = [chunk({"content": "Hel"}), {"object": "error", "message": "prompt too long", "code": 400}]
    with pytest.raises(RequestError, match="prompt too long"):
        events(RecordedServer(replies=[failing]).backend())


def test_a_connection_lost_in_the_middle_of_a_reply_names_the_server():
    def cut(body):
        def pieces():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=pieces())
    with pytest.raises(OmniLocalError, match=f"lost the connection to the server at {URL}"):
        events(RecordedServer(replies=[cut]).backend())


def test_a_server_that_cannot_be_reached_is_a_clear_error_naming_its_address():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(OmniLocalError, match=f"cannot reach the server at {url} .*is it running"):
        RemoteBackend(Settings(backend="openai", backend_url=url))


@pytest.mark.parametrize("status, body, words", [
    (401, {"error": {"message": "Invalid API key"}}, "refused the API key \\(backend_api_key\\): Invalid API key"),
    (404, "Not Found", "is not an OpenAI-compatible API: GET /models answered 404"),
    (200, "<html><body>Welcome</body></html>", "is not an OpenAI-compatible API: GET /models did not list models"),
])
def test_a_wrong_key_or_an_address_that_is_not_an_openai_api_is_a_clear_error_at_start_up(status, body, words):
    def answer(request):
        return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)
    with pytest.raises(OmniLocalError, match=words):
        RemoteBackend(Settings(backend="openai", backend_url=URL), httpx.Client(transport=httpx.MockTransport(answer)))


def test_the_api_key_is_sent_as_a_bearer_token_and_no_openai_account_ids_go_with_it(monkeypatch):
    monkeypatch.setenv("OPENAI_ORG_ID", "org-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-server")
    seen = []

    def answer(request):
        seen.append(request.headers)
        return httpx.Response(200, json={"object": "list", "data": [VLLM_MODEL]})
    client = httpx.Client(transport=httpx.MockTransport(answer))
    RemoteBackend(Settings(backend="openai", backend_url=URL, backend_api_key="k3y"), client)
    RemoteBackend(Settings(backend="openai", backend_url=URL), client)
    assert [headers["authorization"] for headers in seen] == ["Bearer k3y", "Bearer EMPTY"]
    assert not any("openai-organization" in headers for headers in seen)


def test_speech_from_a_server_that_makes_none_is_refused_before_anything_is_sent():
    silent = {**OUR_MODEL, "omni_local": {**OUR_MODEL["omni_local"], "speech": False}}
    server = RecordedServer(models=[silent])
    with pytest.raises(RequestError, match="makes no spoken replies"):
        server.backend().send("chat", QUESTION, GREEDY, SpeechParams("Ethan"))
    assert server.requests == []


# Cancel


def test_a_cancelled_reply_stops_reading_and_ends_with_a_finished_that_says_cancelled():
    held = HeldStream(text_stream([f"{n} " for n in range(20)]), hold_after=3)
    server = RecordedServer(replies=[lambda body: event_stream(held)])
    reply = server.backend().send("chat", QUESTION, GREEDY, None)
    stream = reply.events()
    assert next(stream) == TextDelta("0 ")
    reply.cancel()
    held.released.set()
    rest = list(stream)
    assert len(rest) == 1 and rest[0].stop_reason == "cancelled" and rest[0].text == "0 "
    assert held.sent < len(held.chunks)  # the rest of the stream was never read
    assert rest[0].tokens.generated is None  # no usage came: unknown
    assert "stopped" in metrics_line(rest[0])


def test_each_reply_asks_for_a_connection_of_its_own_with_connection_close():
    server = RecordedServer(replies=[text_stream(["a"])])
    events(server.backend())
    assert server.headers[0]["connection"] == "close"


def test_a_reply_cancelled_before_it_is_read_sends_nothing():
    server = RecordedServer(replies=[text_stream(["a"])])
    reply = server.backend().send("chat", QUESTION, GREEDY, None)
    reply.cancel()
    assert [e.stop_reason for e in reply.events()] == ["cancelled"]
    assert server.requests == []


def test_cancel_from_another_thread_wakes_a_read_waiting_on_a_silent_server_at_once():
    """A real socket: the server sends the headers and one piece, then nothing."""
    with socket_server([chunk({'content': 'Hel'})], hold=True) as url:
        backend = RemoteBackend(Settings(backend="openai", backend_url=url))
        reply = backend.send("chat", QUESTION, GREEDY, None)
        stream = reply.events()
        assert next(stream) == TextDelta("Hel")
        threading.Timer(0.2, reply.cancel).start()
        started = time.monotonic()
        final = next(stream)
        assert final.stop_reason == "cancelled" and time.monotonic() - started < 2
        backend.close()


# What a remote backend's process imports


@pytest.mark.parametrize("module", ["omni_local.backends.remote", "omni_local.ui", "omni_local.ui.chat",
                                    "omni_local.cli", "omni_local.api"])
def test_the_remote_backend_and_the_page_and_cli_on_it_import_neither_torch_nor_the_engine(module):
    check = (f"import sys, {module}; "
             "loaded = [m for m in ('torch', 'transformers', 'omni_local.engine') if m in sys.modules]; "
             "print(','.join(loaded))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""


def test_an_app_on_a_remote_backend_starts_and_answers_without_torch(tmp_path):
    """The app itself, made and asked in a fresh process, with the server on a mock transport."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "support")!r})
from recorded_server import RecordedServer, text_stream
server = RecordedServer(replies=[text_stream(["Hi"])])
backend = server.backend(cache_dir={str(tmp_path)!r})
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams
print(list(backend.send("s", [Message("user", ["Hi?"])], SamplingParams(), None).events())[-1].text)
print("torch" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["Hi", "False"]


def test_the_cli_on_a_server_that_cannot_be_reached_says_so_in_one_line_and_exits_2():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "omni_local", "ask", "Hi?", "--backend", "openai",
                             "--backend-url", f"http://127.0.0.1:{port}/v1"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    url = f"http://127.0.0.1:{port}/v1"
    assert result.stderr.strip().splitlines() == [
        f"error: cannot reach the server at {url} (Connection refused): is it running? (backend_url)"]


def test_the_clis_ask_on_a_remote_server_prints_the_reply_and_its_figures():
    with socket_server(text_stream(["Hello", " there."], omni_local=REPORT)) as url:
        result = subprocess.run([sys.executable, "-m", "omni_local", "ask", "Hi?", "--backend", "openai",
                                 "--backend-url", url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "Hello there.", "TTFT 17 ms · 142 tok/s · 380 of 415 prompt tokens from cache (80 from host memory) · "
        "32 reply tokens · media: 2 encoded, 0 from the encoder cache, 1 in the cached prompt · "
        "1 earlier turn left out to fit 960 tokens · reply length limit reached"]
