"""A typed reply that waits for a seat says so on the page, until its text comes (ui/chat.py's
ChatTurns on an app of one seat)."""

import time
from contextlib import closing

import pytest

from omni_local.api import OmniLocal
from omni_local.ui.chat import ChatTurns
from omni_local.ui.chats import ChatShelves
from omni_local.ui.history import ChatMemory

OPTIONS = {"system_prompt": "", "temperature": 0.0, "top_p": 1.0, "speak": False, "voice": "Ethan", "request": None}
LONG = 200  # tokens: the demo's greedy reply to "Count to one thousand." does not end sooner


@pytest.fixture(scope="module")
def one_seat(demo_settings, demo_checkpoint):
    with OmniLocal(demo_settings.replace(max_running_requests=1)) as app:
        yield app


@pytest.fixture
def turns(one_seat, tmp_path, monkeypatch) -> ChatTurns:
    """The page's turns, each decode step slowed so a long reply surely holds the seat for seconds."""
    runner = one_seat.backend.engine.runner
    decode = runner.decode

    def slow_decode(*args, **kwargs):
        time.sleep(0.01)
        return decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", slow_decode)
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    return ChatTurns(one_seat, ChatShelves(tmp_path / "chats"), uploads)


def ask(turns: ChatTurns, text: str, max_new_tokens: int):
    return turns.respond({"text": text, "files": []}, [], memory=ChatMemory(), max_new_tokens=max_new_tokens,
                         **OPTIONS)


def test_a_reply_waiting_for_the_only_seat_shows_how_many_are_ahead_until_its_first_text(turns):
    with closing(ask(turns, "Count to one thousand.", LONG)) as first:
        assert "Waiting" not in next(first)[0]  # started at once: its text
        second = ask(turns, "Name a colour.", 4)
        assert next(second)[0] == "_Waiting for 1 reply ahead…_"
    # The first reply stopped (as the stop button does): the second starts, its text in the note's place.
    shown = [update[0] for update in second]
    assert isinstance(shown[0], str) and "Waiting" not in shown[0]
    assert all("Waiting" not in str(chat) for chat in shown)
