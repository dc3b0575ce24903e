"""A reply that waits for a seat says so on the page, typed or spoken, until its text comes
(ui/chat.py's ChatTurns and ui/voice_mode.py's VoiceMode on an app of one seat)."""

import time
from contextlib import closing

import pytest
import soundfile

from omni_local.api import OmniLocal
from omni_local.ui.chat import ChatTurns
from omni_local.ui.chats import ChatShelves
from omni_local.ui.history import ChatMemory
from omni_local.ui.voice_mode import PUSH_TO_TALK, TurnContext, VoiceMode
from samples import SPEECH
from waiting import until

OPTIONS = {"system_prompt": "", "temperature": 0.0, "top_p": 1.0, "speak": False, "voice": "Ethan", "request": None}
LONG = 200  # tokens: the demo's greedy reply to "Count to one thousand." does not end sooner
NOTE = "_Waiting for 1 reply ahead…_"


@pytest.fixture(scope="module")
def one_seat(demo_settings, demo_checkpoint):
    with OmniLocal(demo_settings.replace(max_running_requests=1, speech=True, max_speech_seconds=2.0)) as app:
        yield app


@pytest.fixture
def slowed(one_seat, monkeypatch) -> None:
    """Each decode step slowed, so a long reply surely holds the seat for seconds."""
    runner = one_seat.backend.engine.runner
    decode = runner.decode

    def slow_decode(*args, **kwargs):
        time.sleep(0.02)
        return decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", slow_decode)


@pytest.fixture
def uploads(tmp_path):
    folder = tmp_path / "uploads"
    folder.mkdir()
    return folder


def ask(turns: ChatTurns, text: str, max_new_tokens: int):
    return turns.respond({"text": text, "files": []}, [], memory=ChatMemory(), max_new_tokens=max_new_tokens,
                         **OPTIONS)


def test_a_typed_reply_waiting_for_the_only_seat_shows_how_many_are_ahead_until_its_first_text(
        one_seat, slowed, uploads, tmp_path):
    turns = ChatTurns(one_seat, ChatShelves(tmp_path / "chats"), uploads)
    with closing(ask(turns, "Count to one thousand.", LONG)) as first:
        assert "Waiting" not in next(first)[0]  # started at once: its text
        second = ask(turns, "Name a colour.", 4)
        assert next(second)[0] == NOTE
    # The first reply stopped (as the stop button does): the second starts, its text in the note's place.
    shown = [update[0] for update in second]
    assert isinstance(shown[0], str) and "Waiting" not in shown[0]
    assert all("Waiting" not in str(chat) for chat in shown)


def test_a_voice_turn_waiting_for_the_only_seat_shows_how_many_are_ahead_until_its_text(
        one_seat, slowed, uploads, tmp_path):
    voice, memory = VoiceMode(one_seat, uploads, save=lambda *saved: None), ChatMemory()
    asked = TurnContext([], "", memory, {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "voice": "Ethan"})
    voice.start_recording(PUSH_TO_TALK)  # the conversation (and its speech detector) made before the seat is taken
    utterance = tmp_path / "utterance.wav"
    soundfile.write(utterance, SPEECH[:16_000], 16_000)
    blocker = one_seat.session().send("Count to one thousand.", max_new_tokens=LONG, temperature=0.0)
    next(iter(blocker))  # it holds the seat
    voice.hear(str(utterance), PUSH_TO_TALK, asked)
    voice.stop_recording(PUSH_TO_TALK, asked)
    answers: list = []

    def tick() -> list | None:
        chat = voice.deliver(memory, [])[1]  # the page's chat as the timer brings it
        answers.append([m["content"] for m in chat[1:]] if isinstance(chat, list) else None)
        return answers[-1]

    until(lambda: tick() == [NOTE], "the waiting note was not shown")
    blocker.cancel()
    until(lambda: (shown := tick()) and shown[0] != NOTE, "the waiting note stayed")
    assert NOTE not in answers[-1]  # the reply's text took the note's place
    voice.conversation.interrupt()
    voice.conversation.wait()
