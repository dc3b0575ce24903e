"""The chat page's typed turns and voice mode on a remote backend (recorded streams, below Gradio):
a server's reply may report no token counts, and a stopped one never does."""

import threading
from contextlib import closing

from recorded_server import (
    VLLM_MODEL, HeldStream, RecordedServer, event_stream, openai_spoken_stream, remote_app, text_stream, tone,
)
from samples import clip
from waiting import until
from omni_local.api import AudioChunk, Finished
from omni_local.ui.chat import ChatTurns
from omni_local.ui.chats import ChatShelves
from omni_local.ui.history import ChatMemory
from omni_local.voice import VoiceConversation

OPTIONS = {"system_prompt": "", "max_new_tokens": 32, "temperature": 0.0, "top_p": 1.0, "speak": False,
           "voice": "Ethan", "request": None}


def turns_on(app, tmp_path) -> ChatTurns:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    return ChatTurns(app, ChatShelves(tmp_path / "chats"), uploads)


def test_a_remote_reply_shows_its_context_use_from_the_servers_usage(monkeypatch, tmp_path):
    with remote_app(monkeypatch, RecordedServer(replies=[text_stream(["Hi", "!"])])) as app:
        turns, memory = turns_on(app, tmp_path), ChatMemory()
        updates = list(turns.respond({"text": "Hello", "files": []}, [], memory=memory, **OPTIONS))
        assert updates[-1][2] == "Context: 30 of 1,024 tokens"  # usage: 27 prompt and 3 reply tokens


def test_a_reply_whose_server_reports_no_token_counts_ends_with_no_context_use_and_its_chat_reads_back(
        monkeypatch, tmp_path):
    without_usage = text_stream(["Hi", "!"])[:-1]
    with remote_app(monkeypatch, RecordedServer(models=[VLLM_MODEL], replies=[without_usage])) as app:
        turns, memory = turns_on(app, tmp_path), ChatMemory()
        updates = list(turns.respond({"text": "Hello", "files": []}, [], memory=memory, **OPTIONS))
        shown = updates[-1][0]
        assert [m.content for m in shown][0] == "Hi!" and "unknown of unknown prompt tokens" in shown[-1].content
        saved = turns.shelves.of(None).get(memory.session_id)
        assert saved is not None and [m["role"] for m in saved.history] == ["user", "assistant", "assistant"]


def test_a_stopped_remote_reply_is_saved_marked_stopped_and_the_next_turn_sends_it(monkeypatch, tmp_path):
    held = HeldStream(text_stream([f"{n} " for n in range(50)]), hold_after=4)
    server = RecordedServer(replies=[lambda body: event_stream(held), text_stream(["ok"])])
    with remote_app(monkeypatch, server) as app:
        turns, memory = turns_on(app, tmp_path), ChatMemory()
        with closing(turns.respond({"text": "Count.", "files": []}, [], memory=memory, **OPTIONS)) as stream:
            for _ in range(3):
                next(stream)
            held.released.set()
        # closing() is what the stop button does to the reply's stream.
        assert memory.turn.reply.result().stop_reason == "cancelled"
        chat = turns.shelves.of(None).get(memory.session_id).history
        assert "stopped" in chat[-1]["content"] and chat[-1]["metadata"]["title"] == "Metrics"
        list(turns.respond({"text": "Go on.", "files": []}, chat, memory=memory, **OPTIONS))
        assert server.requests[1]["messages"][1] == {"role": "assistant", "content": "0 1 2 "}


def test_voice_barge_in_on_a_remote_reply_cancels_it_and_nothing_plays_after(monkeypatch, tmp_path):
    held = HeldStream(openai_spoken_stream(["Hel", "lo"], [tone(0.1)] * 20), hold_after=4)
    with remote_app(monkeypatch, RecordedServer(replies=[lambda body: event_stream(held)])) as app:
        session, played, shown = app.session(), [], []
        interrupted = threading.Event()

        def play(chunk: AudioChunk) -> None:
            played.append(interrupted.is_set())
        conversation = VoiceConversation(lambda samples: session.send(audio=[samples], speak=True), play,
                                         lambda: None, detector=object(), show=shown.append)
        conversation.answer(clip(1))
        until(lambda: played, "no audio was played")
        conversation.interrupt()
        interrupted.set()
        held.released.set()
        conversation.wait()
        assert isinstance(shown[-1], Finished) and shown[-1].stop_reason == "cancelled"
        assert not any(played)  # no chunk played after the person spoke
