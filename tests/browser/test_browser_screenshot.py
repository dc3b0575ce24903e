"""The README's screenshot (assets/screenshot.png), taken of the page as it is, in a real browser
(tests/support/browser_page.py drives it), against `python app.py` on the demo model with speech on: a few
chats in the sidebar, the settings open, and a chat of two turns about a picture."""

from collections.abc import Iterator

import pytest
from PIL import Image, ImageDraw

from browser_page import ARTIFACTS, ask, drop_file, listed_chats, new_chat, open_settings, wait_for_metrics
from served_app import ServedApp, served_app

CHATS = ["Plan a weekend in Lisbon", "Summarise this recording"]
PICTURE_QUESTIONS = ["What is in this picture?", "What colour is the sky in it?"]
WINDOW = {"width": 1280, "height": 1100}  # the whole chat, its picture too


@pytest.fixture(scope="module")
def served(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_screenshot"),
                    "--max-context-tokens", "8192") as app:
        yield app


def test_the_readme_screenshot_shows_the_chats_the_settings_and_a_chat_about_a_picture(open_tab, tmp_path):
    """Writes test-artifacts/browser/readme/screenshot.png, copied to assets/screenshot.png after a look."""
    page = open_tab(WINDOW)
    for question in CHATS:
        ask(page, question)
        wait_for_metrics(page, 1)
        new_chat(page)
    drop_file(page, landscape(tmp_path / "landscape.png"), "image/png")
    page.locator(".multimodal-textbox .thumbnail-item img").wait_for()
    for turn, question in enumerate(PICTURE_QUESTIONS, 1):
        ask(page, question)
        wait_for_metrics(page, turn)
    open_settings(page)
    page.wait_for_timeout(500)  # the settings' accordion opens with a slide
    page.locator("#chat [role=log]").evaluate("(log) => { log.scrollTop = 0; }")  # from its picture on
    ARTIFACTS.joinpath("readme").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / "readme" / "screenshot.png")
    assert listed_chats(page) == [PICTURE_QUESTIONS[0], *reversed(CHATS)]


def landscape(path):
    """A small drawn landscape: sky, sun, hills."""
    picture = Image.new("RGB", (240, 150), (120, 180, 235))
    draw = ImageDraw.Draw(picture)
    draw.ellipse((172, 18, 210, 56), fill=(250, 210, 60))
    draw.polygon([(0, 150), (0, 98), (82, 60), (165, 105), (240, 75), (240, 150)], fill=(70, 150, 80))
    picture.save(path)
    return path
