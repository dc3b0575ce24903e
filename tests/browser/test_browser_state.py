"""The chat page's state matches what happened, in a real browser (tests/support/browser_page.py drives it),
against `python app.py` on the demo model with speech on: an edited question keeps its attachment,
undo puts back the context line, a voice chat is listed once asked, a reload keeps the chat the tab
shows, a file sent can be attached again (also dropped while its reply streams), and a refused send
says truly where its text is."""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from browser_page import (
    answered_again, ask, attach_file, chat_files, choose_chat, context_use, drop_file, edit_last_question,
    last_metrics, message_box, new_chat, reload, shown_messages, shown_title, start_voice_mode, stop_voice_mode, undo,
    wait_for_metrics, wait_for_note, wait_until, wait_until_saved_as_shown,
)
from served_app import ServedApp, served_app


@pytest.fixture(scope="module")
def served(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    # A voice utterance is the speech and the pause around it: over the 2 s the other UI tests allow.
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_state"), "--max-audio-seconds", "10") as app:
        yield app


def picture(folder: Path, name: str) -> Path:
    path = folder / name
    Image.new("RGB", (64, 48), (200, 40, 20)).save(path)
    return path


def media_in_prompt(metrics: str) -> int:
    """The images, clips and videos a reply's prompt held, by its metrics line (0 if it says none)."""
    counts = re.search(r"media: (\d+) encoded, (\d+) from the encoder cache, (\d+) in the cached prompt", metrics)
    return sum(map(int, counts.groups())) if counts else 0


def test_an_edited_question_with_a_picture_keeps_the_picture_and_gets_a_new_reply(page, shot, served, tmp_path):
    earlier = chat_files(served)
    attach_file(page, picture(tmp_path, "red-square.png"))
    ask(page, "What colour is this?")
    assert media_in_prompt(wait_for_metrics(page, 1)) == 1
    shot("asked")
    answered_again(page, lambda: edit_last_question(page, "Edited: what shape is this?"))
    shot("edited")
    assert [(who, text) for who, text in shown_messages(page) if who == "user"] == [
        ("user", "a component of type image"), ("user", "Edited: what shape is this?")]
    assert media_in_prompt(last_metrics(page)) == 1  # the picture was asked about again
    wait_until_saved_as_shown(page, served, earlier)


def asked(page) -> list[str]:
    return [text for who, text in shown_messages(page) if who == "user"]


def test_undo_puts_back_the_context_use_of_the_turn_it_goes_back_to_also_after_a_reload(page, shot, served):
    ask(page, "Context, turn one")
    wait_for_metrics(page, 1)
    wait_until(page, lambda: context_use(page), "no context use after the first reply")
    first = context_use(page)
    ask(page, "Context, turn two, a longer question than the first one")
    wait_for_metrics(page, 2)
    wait_until(page, lambda: context_use(page) != first, "the context use did not change after the second reply")
    undo(page)
    shot("undone-turn-two")
    wait_until(page, lambda: context_use(page) == first,
               lambda: f"after undoing turn two the page says {context_use(page)!r}, not turn one's {first!r}")
    reload(page, served)
    shot("reloaded")
    assert asked(page) == ["Context, turn one"] and context_use(page) == first
    undo(page)
    shot("undone-turn-one")
    wait_until(page, lambda: context_use(page) == "",
               lambda: f"after undoing the only turn the empty chat says {context_use(page)!r}")


def test_a_chat_begun_by_voice_is_listed_once_its_turn_ends(page, shot):
    start_voice_mode(page)
    wait_for_metrics(page, 1)  # the fake microphone's speech ends in a pause: it is asked and answered
    stop_voice_mode(page)
    shot("answered")
    wait_until(page, lambda: shown_title(page).startswith("Voice chat, "),
               lambda: f"the list shows {shown_title(page)!r} for the voice chat")


def test_a_reload_shows_the_chat_the_tab_showed_not_the_most_recent_one(page, shot, served):
    ask(page, "Viewed chat: the older one")
    wait_for_metrics(page, 1)
    new_chat(page)
    ask(page, "Viewed chat: the newer one")
    wait_for_metrics(page, 1)
    choose_chat(page, "Viewed chat: the older one")
    wait_until(page, lambda: asked(page) == ["Viewed chat: the older one"], "the older chat did not open")
    reload(page, served)
    shot("reloaded")
    assert asked(page) == ["Viewed chat: the older one"]
    assert shown_title(page) == "Viewed chat: the older one"


def test_a_file_sent_can_be_attached_again_at_once(page, shot, tmp_path):
    square = picture(tmp_path, "twice.png")
    attach_file(page, square)
    ask(page, "Once")
    wait_for_metrics(page, 1)
    attach_file(page, square)  # waits until the box shows it
    shot("attached-again")
    ask(page, "Twice")
    assert media_in_prompt(wait_for_metrics(page, 2)) == 2  # turn one's picture, and this one's


def test_a_file_dropped_again_while_its_reply_streams_stays_in_the_box_and_is_sent_next(page, shot, tmp_path):
    square = picture(tmp_path, "dropped-again.png")
    attach_file(page, square)
    ask(page, "First")
    page.wait_for_function("() => document.querySelector('.multimodal-textbox textarea').disabled")  # the reply streams
    drop_file(page, square, "image/png")  # the box takes a drop while its reply streams, as it shows
    attached = page.locator(".multimodal-textbox .thumbnail-item")
    attached.wait_for()
    wait_for_metrics(page, 1)
    wait_until(page, message_box(page).is_enabled, "the message box stayed off after the reply")
    shot("reply-ended")
    assert attached.count() == 1  # still there once the reply has ended
    ask(page, "Second")
    assert media_in_prompt(wait_for_metrics(page, 2)) == 2  # turn one's picture, and this one's


def test_a_send_refused_for_a_change_in_another_tab_says_truly_where_the_message_is(page, shot, open_tab):
    ask(page, "Stale tab: the first question")
    wait_for_metrics(page, 1)
    other = open_tab()  # its start-up shows the most recent chat: this one
    wait_until(other, lambda: asked(other) == ["Stale tab: the first question"], "the second tab shows another chat")
    ask(page, "Stale tab: the first tab asks again")
    wait_for_metrics(page, 2)
    ask(other, "Stale tab: the second tab asks")
    refusal = wait_for_note(other, "Error", "another tab")
    shot("refused", tab=other)
    assert message_box(other).input_value() == ""  # Gradio empties the box when a message is sent
    assert shown_messages(other)[-2:] == [("user", "Stale tab: the second tab asks"), ("bot", refusal)]
    assert "box" not in refusal and "above" in refusal, refusal
