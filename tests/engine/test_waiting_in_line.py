"""Requests beyond the engine's seats wait in line, in order, each told its place as it changes."""

import time

import pytest

from omni_local.api import OmniLocal
from omni_local.protocol.events import Finished, Waiting

QUESTION = "Count to one thousand."  # the demo's greedy reply to it is long: it holds its seat


@pytest.fixture(scope="module")
def one_seat(demo_settings, demo_checkpoint):
    with OmniLocal(demo_settings.replace(max_running_requests=1)) as app:
        yield app


@pytest.fixture
def prefill_after_two_more(one_seat, monkeypatch):
    """The first prefill waits until two more requests have their prompts built (in line already, or
    still to be taken in), so that they wait while the first request holds the only seat."""
    engine = one_seat.backend.engine
    original = engine.runner.prefill

    def prefill(*args, **kwargs):
        deadline = time.monotonic() + 30
        while engine.queued + len(engine.scheduler.waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        monkeypatch.setattr(engine.runner, "prefill", original)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill", prefill)


def places(events: list) -> list[int]:
    """The places a reply was told, checking it was told them before anything else came."""
    told = [event.ahead for event in events if isinstance(event, Waiting)]
    assert all(isinstance(event, Waiting) for event in events[:len(told)])
    return told


def test_requests_beyond_the_seats_are_told_their_place_until_they_start_and_one_started_at_once_none(
        one_seat, prefill_after_two_more):
    first, second, third = (one_seat.session().send(QUESTION, max_new_tokens=8, temperature=0.0) for _ in range(3))
    seen = [list(reply) for reply in (first, second, third)]
    assert all(isinstance(events[-1], Finished) for events in seen)
    assert places(seen[0]) == []  # admitted at once
    assert places(seen[1]) == [1]  # waits for the first's seat
    assert places(seen[2]) == [2, 1]  # behind the second, then first in line once the second starts


def test_a_reply_says_how_many_are_ahead_while_it_waits_and_none_once_it_streams(one_seat, prefill_after_two_more):
    first, second, third = (one_seat.session().send(QUESTION, max_new_tokens=8, temperature=0.0) for _ in range(3))
    stream = iter(third)
    assert next(stream) == Waiting(2) and third.waiting == 2
    assert next(stream) == Waiting(1) and third.waiting == 1
    next(stream)  # its first text
    assert third.waiting == 0
    assert (first.waiting, second.waiting) == (0, 0)  # not read yet: none said
    third.result()
