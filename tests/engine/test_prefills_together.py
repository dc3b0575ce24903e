"""Prompts that wait together are computed in one forward, their tokens packed in one row (the
experts' weights read once for all of them), and each reply is the one its prompt gets alone: with
every cache and with none, text and images, tails on cached conversations, and the Talker rows of a
spoken reply's prompt."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from unittest.mock import patch

import numpy as np
import pytest

from device_under_test import TEST_DEVICE
from replies import media
from samples import picture
from omni_local.api import OmniLocal
from omni_local.errors import RequestError

WORDS = "amber basil cedar delta ember fjord grove harbor iris juniper kestrel lagoon meadow nectar orchid pebble".split()


# On a GPU: eager prefills (packed prompts run eagerly; with graphs, each prompt replays its own), and
# the deterministic setting, under which a token's numbers do not depend on who else is in its forward.
ON_GPU = {"cuda_graphs": False, "deterministic": True} if TEST_DEVICE != "cpu" else {}


@pytest.fixture(scope="module")
def apps(demo_settings, make_apps) -> tuple[OmniLocal, OmniLocal]:
    return make_apps(demo_settings.replace(**ON_GPU))


def question(i: int) -> str:
    """About 100 tokens, different for every `i`."""
    return f"Question {i}: " + " ".join(f"{WORDS[(i + k) % len(WORDS)]} {k * (i + 3)}" for k in range(11)) + "?"


@contextmanager
def forwards(app: OmniLocal) -> Iterator[list[int]]:
    """Meanwhile, how many prompts each prefill forward of the app computes, in order."""
    runner, counts = app.backend.engine.runner, []
    alone, together = runner.prefill, runner.prefill_together

    def one(table, prepared):
        counts.append(1)
        return alone(table, prepared)

    def several(parts):
        counts.append(len(parts))
        return together(parts)

    with patch.object(runner, "prefill", one), patch.object(runner, "prefill_together", several):
        yield counts


def sent_at_once(app: OmniLocal, asks: list[tuple], **options) -> list:
    """The finished replies to each (session, parts) ask, all sent while another session's one-token
    question is prefilled: once it ends, they all wait together for the next turn, nobody decoding."""
    runner, entered, sent = app.backend.engine.runner, threading.Event(), threading.Event()
    recording = runner.prefill

    def holding_the_turn(table, prepared):
        entered.set()
        sent.wait(timeout=30)
        return recording(table, prepared)

    def send(session, parts):
        return session.send(*[p for p in parts if isinstance(p, str)], **media(parts), max_new_tokens=6, **options)

    with patch.object(runner, "prefill", holding_the_turn):
        first = app.session().send("Wait.", max_new_tokens=1)
        assert entered.wait(timeout=30)
        replies = [send(*ask) for ask in asks]
        sent.set()
        first.result()
    for reply in replies:  # each done (one that failed raises again where its caller reads it)
        with suppress(RequestError):
            reply.result()
    return replies


def alone(app: OmniLocal, parts: list, **options):
    """The finished reply to `parts` sent alone, by a new session."""
    reply = app.session().send(*[p for p in parts if isinstance(p, str)], **media(parts), max_new_tokens=6, **options)
    reply.result()
    return reply


def tokens(replies: list) -> list[list[int]]:
    return [reply.result().token_ids for reply in replies]


def together_and_alone(apps: tuple[OmniLocal, OmniLocal], prompts: list[list]) -> tuple[list, list, list]:
    """The replies' tokens to `prompts` sent at once, with every cache and with none, and sent one by
    one with none (the oracle: nothing cached of the others' prompts), and the forwards' counts."""
    cached, uncached = apps
    counts, together = [], []
    for app in (cached, uncached):
        with forwards(app) as counted:
            together.append(tokens(sent_at_once(app, [(app.session(), p) for p in prompts])))
        counts.append(counted)
    return counts, together, tokens([alone(uncached, prompt) for prompt in prompts])


def test_sixteen_questions_sent_at_once_are_prefilled_in_one_forward_and_answered_as_each_alone(apps):
    counts, together, alone_ = together_and_alone(apps, [[question(i)] for i in range(16)])
    assert counts == [[1, 16]] * 2
    assert together == [alone_] * 2
    assert len({tuple(reply) for reply in alone_}) > 1  # the chats computed tokens of their own


def test_pictures_and_text_prefilled_together_are_answered_as_each_alone(apps):
    prompts = [[question(0)], [picture(5), "What is in this picture?"], [question(1)],
               [picture(6), question(2)], [question(3)]]
    counts, together, alone_ = together_and_alone(apps, prompts)
    assert counts == [[1, 5]] * 2
    assert together == [alone_] * 2


def test_second_turns_sent_at_once_are_prefilled_together_after_their_conversations_rows(apps):
    cached, uncached = apps
    seconds = [[f"And then {question(10 + i)}"] for i in range(4)]
    results = []
    for app in (cached, uncached):
        sessions = [app.session() for _ in seconds]
        for i, session in enumerate(sessions):
            session.send(question(i), max_new_tokens=4).result()
        with forwards(app) as counts:
            together = tokens(sent_at_once(app, list(zip(sessions, seconds))))
        results.append((counts, together))
    twins = [uncached.session() for _ in seconds]
    for i, twin in enumerate(twins):
        twin.send(question(i), max_new_tokens=4).result()
    one_by_one = [twin.send(*second, max_new_tokens=6).result().token_ids for twin, second in zip(twins, seconds)]
    assert results == [([1, 4], one_by_one)] * 2


def test_prompts_whose_forward_together_fails_are_computed_alone_and_only_one_whose_own_fails_fails(apps):
    app = apps[1]
    runner = app.backend.engine.runner
    prefills, prefill = [], runner.prefill

    def broken_together(parts):
        raise RuntimeError("the forward of several broke")

    def second_breaks(table, prepared):  # the first prefill is the one-token question holding the turn
        prefills.append(prepared)
        if len(prefills) == 3:
            raise RuntimeError("this prompt's own forward broke")
        return prefill(table, prepared)

    with patch.object(runner, "prefill_together", broken_together), patch.object(runner, "prefill", second_breaks):
        first, broken, third = sent_at_once(app, [(app.session(), [question(i)]) for i in range(3)])
        with pytest.raises(RequestError, match="own forward broke"):
            broken.result()
        answered = tokens([first, third])
    assert len(prefills) == 4
    assert answered == tokens([alone(app, [question(0)]), alone(app, [question(2)])])


@pytest.fixture(scope="module")
def speaking(demo_settings, demo_checkpoint) -> Iterator[OmniLocal]:
    """Spoken replies, with no cache: a reply alone computes its own Talker rows."""
    settings = demo_settings.replace(speech=True, max_speech_seconds=2.0, prefix_cache=False, encoder_cache=False,
                                     **ON_GPU)
    with OmniLocal(settings) as app:
        yield app


def test_spoken_replies_to_questions_prefilled_together_say_what_each_alone_says(speaking):
    prompts = [[question(0)], [picture(7), "Say what you see."]]
    spoken = {"speak": True, "talker_temperature": 0.0}
    with forwards(speaking) as counts:
        together = sent_at_once(speaking, [(speaking.session(), p) for p in prompts], **spoken)
    assert counts == [1, 2]
    for reply, prompt in zip(together, prompts):
        by_itself = alone(speaking, prompt, **spoken)
        assert reply.result().token_ids == by_itself.result().token_ids
        assert reply.audio.size and np.array_equal(reply.audio, by_itself.audio)
