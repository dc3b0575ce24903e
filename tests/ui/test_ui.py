"""The chat UI as a user meets it: `python app.py` on 127.0.0.1, driven through gradio_client.

The app runs once for the file, as a subprocess with every setting on its command line. Each test
opens its own `Client`: a client is one browser tab, so its turns share one chat history.
"""

import base64
import ipaddress
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
from gradio_client import Client, handle_file
from gradio_client.exceptions import AuthenticationError
from PIL import Image

from bad_files import BAD_FILES, LIMITS, media_error
from chats import written_tokens
from samples import video_file
from served_app import free_port, running_app
from waiting import until
from omni_local.media import load_image
from omni_local.protocol.messages import Message
from omni_local.settings import Settings
from omni_local.ui.history import ERROR_TITLE, to_messages

METRICS = re.compile(
    r"TTFT [\d.,]+ m?s( \(queued [\d.,]+ m?s\))?( · [\d.,]+ tok/s)? · "
    r"(?P<reused>[\d,]+) of (?P<prompt>[\d,]+) prompt tokens from cache( \([\d,]+ from host memory\))? · "
    r"(?P<generated>[\d,]+) reply tokens?"
    r"( · media: (?P<encoded>\d+) encoded, (?P<from_cache>\d+) from the encoder cache, \d+ in the cached prompt)?"
    r"( · (?P<stop>reply length limit reached))?"
)
STOP_REASONS = {None: "end_of_turn", "reply length limit reached": "max_new_tokens"}  # as the line says them


@pytest.fixture(scope="module")
def ui_url(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[str]:
    """`python app.py` on a free port, the demo model from the shared test folder; stopped after the file."""
    with running_app(demo_settings, tmp_path_factory.mktemp("ui")) as url:
        yield url


def test_app_py_serves_the_chat_page_on_127_0_0_1(ui_url):
    with urllib.request.urlopen(ui_url, timeout=10) as response:
        assert response.status == 200
        assert "omni_local" in response.read().decode()


def test_uploads_are_kept_in_the_apps_private_folder(demo_settings, demo_checkpoint, tmp_path):
    with running_app(demo_settings, tmp_path) as url:
        _ask(Client(url, verbose=False), "What is this?", _png(tmp_path / "red.png", (64, 48)))
        uploads = tmp_path / "cache" / "uploads"
        assert any(p.name == "red.png" for p in uploads.rglob("*"))
        assert uploads.stat().st_mode & 0o777 == 0o700


def test_with_credentials_the_ui_asks_for_them(demo_settings, demo_checkpoint, tmp_path):
    credentials = tmp_path / "users"
    credentials.write_text("ada:lovelace\n")
    credentials.chmod(0o600)
    with running_app(demo_settings, tmp_path, "--ui-credentials-file", str(credentials)) as url:
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            Client(url, verbose=False)
        assert _ask(Client(url, auth=("ada", "lovelace"), verbose=False), "Hello").reply


def test_with_logins_nobody_lists_opens_renames_or_deletes_another_users_chats(demo_settings, demo_checkpoint,
                                                                             tmp_path):
    credentials = tmp_path / "users"
    credentials.write_text("ada:lovelace\nalan:turing\n")
    credentials.chmod(0o600)
    with running_app(demo_settings, tmp_path, "--ui-credentials-file", str(credentials)) as url:
        ada = Client(url, auth=("ada", "lovelace"), verbose=False)
        _ask(ada, "Ada's secret plan")
        ada_chats = dict(ada.predict(api_name="/new_chat")[2]["choices"])
        alan = Client(url, auth=("alan", "turing"), verbose=False)
        assert alan.predict(api_name="/new_chat")[2]["choices"] == []
        history, *_ = alan.predict(ada_chats["Ada's secret plan"], api_name="/open_chat")
        assert history == []  # her chat's id opens a new, empty chat for him
        alan.predict("Mine now", api_name="/rename_chat")
        alan.predict(api_name="/delete_chat")
        _ask(alan, "Alan's own question")
        assert set(dict(ada.predict(api_name="/new_chat")[2]["choices"])) == {"Ada's secret plan"}
        history, *_ = ada.predict(ada_chats["Ada's secret plan"], api_name="/open_chat")
        assert "Ada's secret plan" in str(history[0]["content"])


def test_two_tabs_stream_their_replies_at_the_same_time(ui_url):
    first, second = Client(ui_url, verbose=False), Client(ui_url, verbose=False)
    long_reply = {"text": "Count to one thousand.", "files": []}
    streaming = first.submit(long_reply, "", 400, 0.0, 1.0, api_name="/chat")
    try:
        until(streaming.outputs, "the first reply did not begin to stream", 60)
        other = second.submit({"text": "Hello?", "files": []}, "", 4, 0.0, 1.0, api_name="/chat")
        until(other.outputs, "the other chat's reply did not begin to stream", 60)
        assert not streaming.done(), "the second tab's reply waited for the first tab's to end"
    finally:
        streaming.cancel()


def test_a_chat_changed_in_another_tab_refuses_this_tabs_send_and_keeps_the_other_tabs_turn(ui_url):
    first = Client(ui_url, verbose=False)
    _ask(first, "Shared chat")
    chat_id = dict(first.predict(api_name="/new_chat")[2]["choices"])["Shared chat"]
    first.predict(chat_id, api_name="/open_chat")
    second = Client(ui_url, verbose=False)
    second.predict(chat_id, api_name="/open_chat")  # the same chat in a second tab
    _ask(first, "Asked in the first tab")
    refused, *_ = second.predict({"text": "Asked in the second tab", "files": []}, "", api_name="/chat")
    assert refused["metadata"]["title"] == ERROR_TITLE and "another tab" in refused["content"]
    history, *_ = second.predict(chat_id, api_name="/open_chat")  # opened again, it has both of the first tab's
    asked = [str(m["content"]) for m in history if m["role"] == "user"]
    assert len(asked) == 2 and "Asked in the first tab" in asked[1]
    assert _ask(second, "Now from the second tab").reply  # and goes on from there


def test_the_ui_listens_on_the_loopback_address_and_nowhere_else(ui_url):
    port = int(ui_url.rstrip("/").rsplit(":", 1)[1])
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp to list listening sockets")
    assert _listening_addresses(port) == {ipaddress.ip_address("127.0.0.1")}
    for address in _non_loopback_addresses():
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=2).close()


def test_a_reply_streams_in_growing_parts_and_ends_with_the_reply_and_its_metrics(ui_url):
    job = Client(ui_url, verbose=False).submit(
        {"text": "Tell me a story about a lighthouse keeper.", "files": []}, "", api_name="/chat"
    )
    outputs = [shown for shown, *_ in job]  # the chat; the audio feed (unused without speech) and context use
    *partials, final = outputs
    assert len(partials) >= 3 and all(isinstance(p, str) for p in partials)
    assert all(later.startswith(earlier) for earlier, later in zip(partials, partials[1:]))
    assert len(partials[-1]) > len(partials[0])
    reply, metrics = final
    assert reply["role"] == "assistant" and not reply["metadata"]
    assert reply["content"].startswith(partials[-1]) and reply["content"]
    assert metrics["metadata"]["title"] == "Metrics"
    assert METRICS.fullmatch(metrics["content"])


def test_the_reply_length_setting_reaches_the_engine(ui_url):
    client = Client(ui_url, verbose=False)
    (_, metrics), *_ = client.predict({"text": "Tell me a story.", "files": []}, "", 3, 0.0, 1.0, api_name="/chat")
    counts = METRICS.fullmatch(metrics["content"])
    assert counts["generated"] == "3" and counts["stop"] == "reply length limit reached"


def _spoken_reply(ui_url: str) -> tuple[list, dict[int, dict]]:
    """One spoken reply's outputs and its audio chunks by index. The Talker samples with a fresh seed,
    and the demo's speech sometimes ends within its first chunk (1 reply in 40); such a reply streams
    nothing to check, so it is asked again (three short replies in a row: 1 in 64,000, computed)."""
    for _ in range(3):
        job = Client(ui_url, verbose=False).submit({"text": "Say something.", "files": []}, "", 8, 0.0, 1.0, True,
                                                   "Chelsie", api_name="/chat")
        outputs = list(job)
        chunks = {feed["index"]: feed for _, feed, *_ in outputs if isinstance(feed, dict) and "pcm" in feed}
        if len(chunks) >= 2:
            break
    return outputs, chunks


def test_a_spoken_reply_streams_its_audio_to_the_page_and_stays_in_the_chat_to_play_again(ui_url):
    outputs, chunks = _spoken_reply(ui_url)
    assert sorted(chunks) == list(range(len(chunks))) and len(chunks) >= 2  # every chunk, in order
    streamed = sum(len(base64.b64decode(chunk["pcm"])) // 2 for chunk in chunks.values())
    reply, spoken, metrics = outputs[-1][0]
    assert spoken["metadata"]["title"] == "Spoken reply" and metrics["metadata"]["title"] == "Metrics"
    samples, rate = soundfile.read(spoken["content"])  # gradio_client fetched the file it points to
    assert rate == 24_000 and len(samples) == streamed  # the replayable reply is what was streamed
    assert "of speech (Chelsie)" in metrics["content"]


def test_an_uploaded_image_reaches_the_model_and_gets_a_reply(ui_url, tmp_path):
    question = "What colour is this picture?"
    text_only = _ask(Client(ui_url, verbose=False), question)
    with_image = _ask(Client(ui_url, verbose=False), question, _png(tmp_path / "red.png", (64, 48)))
    assert with_image.reply
    # The image's tokens are in the prompt, so it reached the model.
    assert with_image.prompt_tokens > text_only.prompt_tokens


@pytest.mark.torchvision
def test_an_uploaded_video_reaches_the_model_and_a_follow_up_computes_only_its_new_tokens(ui_url, tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_file(3))
    client = Client(ui_url, verbose=False)
    first = _ask(client, "What happens in this video?", clip)
    assert first.reply and first.prompt_tokens > 200  # frames and sound track
    follow_up = _ask(client, "And then?")
    cached = written_tokens(first.prompt_tokens, first.generated_tokens, first.stop_reason)
    assert follow_up.computed_tokens == follow_up.prompt_tokens - cached


def test_a_follow_up_question_carries_the_earlier_image_turn(ui_url, tmp_path):
    client = Client(ui_url, verbose=False)
    first = _ask(client, "What is in this picture?", _png(tmp_path / "green.png", (64, 48), (20, 200, 40)))
    follow_up = _ask(client, "And what colour is it?")
    assert follow_up.prompt_tokens > first.prompt_tokens + first.generated_tokens


def test_a_follow_up_in_the_same_chat_computes_only_its_new_tokens(ui_url, tmp_path):
    client = Client(ui_url, verbose=False)
    first = _ask(client, "Describe this picture.", _png(tmp_path / "blue.png", (96, 64), (20, 40, 220)))
    follow_up = _ask(client, "Is there anything else?")
    # The first turn's prompt and reply are in the cache as generated (the last sampled token is
    # computed only when the reply did not end on its own).
    cached = written_tokens(first.prompt_tokens, first.generated_tokens, first.stop_reason)
    assert follow_up.computed_tokens == follow_up.prompt_tokens - cached


def test_stopping_a_reply_stops_the_engine_not_only_the_page(demo_settings, demo_checkpoint):
    from omni_local.api import OmniLocal
    from omni_local.ui.chat import build_ui

    with OmniLocal(demo_settings.replace(max_new_tokens=900)) as app:
        stops = []
        finish, decode = app.backend.engine.endings.finish, app.backend.engine.runner.decode
        app.backend.engine.endings.finish = lambda request, reason: stops.append(reason) or finish(request, reason)
        app.backend.engine.runner.decode = lambda *a, **k: time.sleep(0.01) or decode(*a, **k)  # a reply of seconds
        app.backend.engine.eos_ids = set()  # and one that does not end on its own
        ui = build_ui(app)
        port = free_port()
        ui.launch(server_port=port, prevent_thread_lock=True)
        try:
            job = Client(f"http://127.0.0.1:{port}/", verbose=False).submit(
                {"text": "Tell me a long story.", "files": []}, "", api_name="/chat"
            )
            deadline = time.monotonic() + 60
            while not job.outputs():  # the reply is streaming
                assert time.monotonic() < deadline and not job.done(), "the reply never started"
                time.sleep(0.05)
            job.cancel()  # what the stop button does
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            ui.close()
    assert stops == ["cancelled"]


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_upload_shows_its_error_in_the_chat_and_the_next_question_is_answered(ui_url, bad_files, case):
    path, phrase = bad_files[case]
    client = Client(ui_url, verbose=False)  # one chat: the failed turn stays in its history
    shown, *_ = client.predict({"text": "Look at this.", "files": [handle_file(str(path))]}, "", api_name="/chat")
    assert shown["metadata"] == {"title": ERROR_TITLE}
    assert phrase in shown["content"]
    assert shown["content"] == media_error(path)  # word for word what omni_local.media says
    assert _ask(client, "Are you still there?").reply


def test_a_second_turn_from_the_browser_gives_the_model_only_the_answered_history(tmp_path):
    # The history exactly as Gradio 6.31 passed it from the browser (logged from a real request),
    # after a question with an image, then a question whose upload failed.
    image, bad = _png(tmp_path / "red.png", (64, 48)), tmp_path / "bad.wav"
    bad.write_text("not sound")
    history = [
        {"role": "user", "metadata": None, "options": None, "content": [
            {"type": "file", "alt_text": None, "file": _file_data(image, "image/png")},
            {"type": "text", "text": "What is this?"},
        ]},
        {"role": "assistant", "metadata": {}, "options": [], "content": [{"type": "text", "text": "A red square."}]},
        {"role": "assistant", "metadata": {"title": "Metrics"}, "options": [],
         "content": [{"type": "text", "text": "[18 prompt tokens, ...]"}]},
        {"role": "user", "metadata": None, "options": None, "content": [
            {"type": "file", "alt_text": None, "file": _file_data(bad, "audio/wav")},
            {"type": "text", "text": "listen"},
        ]},
        {"role": "assistant", "metadata": {"title": ERROR_TITLE}, "options": [],
         "content": [{"type": "text", "text": "bad.wav: not an audio file (WAV, FLAC, OGG or MP3 expected)"}]},
    ]
    _assert_one_answered_image_turn(to_messages(history, _app()))


def test_a_second_turn_through_the_api_gives_the_model_only_the_answered_history(tmp_path):
    # The same chat as gradio_client's /chat endpoint keeps it (logged from a real request): files as
    # {"path": ...}, text as plain strings, the replies as ChatMessage fields.
    image, bad = _png(tmp_path / "red.png", (64, 48)), tmp_path / "bad.wav"
    bad.write_text("not sound")
    history = [
        {"role": "user", "content": [{"path": str(image)}, "What is this?"]},
        {"role": "assistant", "metadata": {}, "options": [], "content": "A red square."},
        {"role": "assistant", "metadata": {"title": "Metrics"}, "options": [], "content": "[18 prompt tokens, ...]"},
        {"role": "user", "content": [{"path": str(bad)}, "listen"]},
        {"role": "assistant", "metadata": {"title": ERROR_TITLE}, "options": [],
         "content": "bad.wav: not an audio file (WAV, FLAC, OGG or MP3 expected)"},
    ]
    _assert_one_answered_image_turn(to_messages(history, _app()))


def test_a_chat_decodes_each_upload_once_however_many_turns_follow(tmp_path, monkeypatch):
    import omni_local.ui.history as history_module

    reads = []
    monkeypatch.setattr(history_module, "load_image",
                        lambda path, limits: reads.append(path) or load_image(path, limits))
    image = _png(tmp_path / "red.png", (64, 48))
    history = [
        {"role": "user", "content": [{"path": str(image)}, "What is this?"]},
        {"role": "assistant", "metadata": {}, "options": [], "content": "A red square."},
    ]
    memory = history_module.ChatMemory()
    sent = history_module.decoded_media([str(image)], _app(), memory)  # the question as it is sent
    first, second = to_messages(history, _app(), memory), to_messages(history, _app(), memory)
    assert reads == [str(image)]
    assert second[0].parts[0] is first[0].parts[0] is sent["images"][0]


def test_a_chat_keeps_only_its_most_recently_used_uploads_decoded_past_its_byte_budget(tmp_path, monkeypatch):
    import omni_local.ui.history as history_module

    monkeypatch.setattr(history_module, "KEPT_MEDIA_BYTES", 2 * 64 * 48 * 3)  # two of these images
    images = [str(_png(tmp_path / f"{colour}.png", (64, 48))) for colour in ("red", "green", "blue")]
    memory = history_module.ChatMemory()
    for path in [images[0], images[1], images[0], images[2]]:
        history_module.decoded_media([path], _app(), memory)
    assert list(memory.media) == [images[0], images[2]]  # green, the least recently used, went


def test_a_turn_rebuilt_from_the_page_has_its_parts_in_the_order_it_was_sent(tmp_path):
    # Gradio keeps uploads in upload order; `send` gives images, sounds, then text: the rebuilt
    # turn must be the prompt that was sent, or its cached KV would not match.
    sound, image = tmp_path / "hum.wav", _png(tmp_path / "red.png", (64, 48))
    soundfile.write(sound, np.zeros(16_000, np.float32), 16_000)
    history = [
        {"role": "user", "content": [{"path": str(sound)}, {"path": str(image)}, "What are these?"]},
        {"role": "assistant", "metadata": {}, "options": [], "content": "A hum and a square."},
    ]
    parts = to_messages(history, _app())[0].parts
    assert [type(p) for p in parts] == [Image.Image, np.ndarray, str]


def test_a_question_stopped_before_any_reply_is_left_out_of_the_history():
    history = [
        {"role": "user", "content": ["First question"]},
        {"role": "user", "content": ["Second question"]},
        {"role": "assistant", "metadata": {}, "content": "Second answer"},
    ]
    expected = [Message("user", ["Second question"]), Message("assistant", ["Second answer"])]
    assert to_messages(history, _app()) == expected


# Helpers


@dataclass(frozen=True)
class _Answer:
    reply: str
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int
    stop_reason: str


def _ask(client: Client, text: str, upload: Path | None = None) -> _Answer:
    """One turn in `client`'s chat; fails unless it got a reply and its metrics (no error)."""
    files = [handle_file(str(upload))] if upload else []
    result, *_ = client.predict({"text": text, "files": files}, "", api_name="/chat")
    assert isinstance(result, list), f"expected a reply and its metrics, got {result!r}"
    reply, metrics = result
    assert not reply["metadata"] and metrics["metadata"]["title"] == "Metrics"
    counts = METRICS.fullmatch(metrics["content"])
    assert counts, metrics["content"]
    prompt, reused, generated = (int(counts[name].replace(",", "")) for name in ("prompt", "reused", "generated"))
    return _Answer(reply=reply["content"], prompt_tokens=prompt, generated_tokens=generated,
                   computed_tokens=prompt - reused, stop_reason=STOP_REASONS[counts["stop"]])


def _assert_one_answered_image_turn(messages: list[Message]) -> None:
    assert [m.role for m in messages] == ["user", "assistant"]
    picture, text = messages[0].parts
    assert isinstance(picture, Image.Image) and picture.size == (64, 48)
    assert text == "What is this?"
    assert messages[1].parts == ["A red square."]


def _app() -> SimpleNamespace:
    return SimpleNamespace(limits=LIMITS, settings=Settings())  # all `to_messages` reads from the app


def _file_data(path: Path, mime_type: str) -> dict:
    return {"path": str(path), "url": f"/gradio_api/file={path}", "size": None, "orig_name": None,
            "mime_type": mime_type, "is_stream": False, "meta": {"_type": "gradio.FileData"}}


def _png(path: Path, size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def _listening_addresses(port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of the sockets listening on `port`, from the kernel's own tables."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            found.add(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def _non_loopback_addresses() -> set[str]:
    """This machine's own IPv4 addresses other than 127.x, where it has any."""
    addresses = set()
    try:
        addresses |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: picks the outgoing address, sends nothing
            addresses.add(probe.getsockname()[0])
        except OSError:
            pass
    return {a for a in addresses if not ipaddress.ip_address(a).is_loopback and a != "0.0.0.0"}


def test_chats_are_kept_apart_switched_renamed_deleted_and_survive_a_restart(demo_settings, demo_checkpoint, tmp_path):
    with running_app(demo_settings, tmp_path) as url:
        client = Client(url, verbose=False)
        first = _ask(client, "Hello there")
        history, system_prompt, chooser, title, context = client.predict(api_name="/new_chat")
        assert (history, system_prompt, title, context) == ([], "", "", "")
        _ask(client, "A second chat")
        chats = dict(client.predict(api_name="/new_chat")[2]["choices"])
        assert set(chats) == {"Hello there", "A second chat"}
        # Back in the first chat, its own cache session goes on: only the follow-up is computed.
        history, *_ = client.predict(chats["Hello there"], api_name="/open_chat")
        assert history[0]["role"] == "user" and "Hello there" in str(history[0]["content"])
        follow_up = _ask(client, "And then?")
        cached = written_tokens(first.prompt_tokens, first.generated_tokens, first.stop_reason)
        assert follow_up.computed_tokens == follow_up.prompt_tokens - cached
    with running_app(demo_settings, tmp_path) as url:  # a restart of the app
        client = Client(url, verbose=False)
        history, _, chooser, _, context = client.predict(chats["Hello there"], api_name="/open_chat")
        assert re.fullmatch(r"Context: \d+ of 8,192 tokens", context)
        assert len([m for m in history if m["role"] == "user"]) == 2
        renamed = dict(client.predict("Greetings", api_name="/rename_chat")["choices"])
        assert renamed == {"Greetings": chats["Hello there"], "A second chat": chats["A second chat"]}
        _, _, chooser, *_ = client.predict(api_name="/delete_chat")
        assert dict(chooser["choices"]) == {"A second chat": chats["A second chat"]}


def test_deleting_a_chat_deletes_the_spoken_replies_it_kept(demo_settings, demo_checkpoint, tmp_path):
    with running_app(demo_settings, tmp_path) as url:
        client = Client(url, verbose=False)
        client.predict({"text": "Say hello.", "files": []}, "", 4, 0.0, 1.0, True, "Ethan", api_name="/chat")
        kept = list((tmp_path / "cache" / "uploads").glob("reply-*.wav"))
        assert len(kept) == 1
        client.predict(api_name="/delete_chat")
        assert not kept[0].exists()
