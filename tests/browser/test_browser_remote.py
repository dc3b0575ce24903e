"""The chat page on a remote backend, in a real browser (tests/support/browser_page.py drives it): `python
app.py --backend openai` pointed at `python -m omni_local serve`, each a subprocess on the demo
model, speech on. The page's own process loads no model: every reply comes from the server."""

import re
from collections.abc import Iterator

import pytest
from PIL import Image

from browser_page import (
    ask, assert_each_chunk_played_as_it_came, bot_texts, drop_file, play_spoken_reply_again, set_speak_replies,
    wait_for_metrics,
)
from served_api import served_api
from served_app import ServedApp, served_app


@pytest.fixture(scope="module")
def server(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_api(demo_settings, tmp_path_factory.mktemp("browser_server"), "--speech", "true",
                    "--max-speech-seconds", "1") as api:
        yield api


@pytest.fixture(scope="module")
def served(server, demo_settings, tmp_path_factory) -> Iterator[ServedApp]:
    """The page, on the server above (browser_page's tabs open it)."""
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_remote"), "--backend", "openai",
                    "--backend-url", server.url) as page:
        yield page


def test_the_header_says_the_page_runs_on_the_remote_server(page, server):
    header = page.locator("#omni-header").inner_text()
    assert f"remote: {server.url}" in header and "speech on" in header


def test_a_typed_question_is_answered_by_the_server_and_its_next_turn_reuses_the_first(page, shot):
    ask(page, "Hello there.")
    first = wait_for_metrics(page, 1)
    ask(page, "And then?")
    second = wait_for_metrics(page, 2)
    shot("answered")
    assert all(bot_texts(page))
    assert re.search(r"\b0 of \d+ prompt tokens from cache", first), first
    reused, prompt = map(int, re.search(r"([\d,]+) of ([\d,]+) prompt tokens from cache", second).groups())
    assert 0 < reused < prompt, second  # the server's cache held the first turn, its reply included


def test_an_image_dropped_into_the_message_box_reaches_the_server(page, shot, tmp_path):
    picture = tmp_path / "red-square.png"
    Image.new("RGB", (64, 48), (220, 30, 30)).save(picture)
    drop_file(page, picture, "image/png")
    page.locator(".multimodal-textbox .thumbnail-item img").wait_for()
    ask(page, "What is in this picture?")
    metrics = wait_for_metrics(page, 1)
    shot("answered")
    encoded, from_cache = map(int, re.search(r"media: (\d+) encoded, (\d+) from the encoder cache", metrics).groups())
    assert encoded + from_cache == 1


def test_a_spoken_reply_from_the_server_plays_as_it_streams_and_again_when_clicked(page, shot):
    set_speak_replies(page)
    ask(page, "Say something.")
    metrics = wait_for_metrics(page, 1)
    shot("answered")
    assert "s of speech" in metrics
    assert_each_chunk_played_as_it_came(page)
    play_spoken_reply_again(page)
    shot("playing-again")
