"""The chat page's state matches what happened, in a real browser (tests/browser_page.py drives it),
against `python app.py` on the demo model with speech on: an edited question keeps its attachment,
undo puts back the context line, a voice chat is listed once asked, a reload keeps the chat the tab
shows, a file sent can be attached again, and a refused send says truly where its text is."""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from browser_page import (
    answered_again, ask, attach_file, chat_files, edit_last_question, last_metrics, shown_messages,
    wait_for_metrics, wait_until_saved_as_shown,
)
from served_app import ServedApp, served_app


@pytest.fixture(scope="module")
def served(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_state")) as app:
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
