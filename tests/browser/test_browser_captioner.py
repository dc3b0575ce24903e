"""The chat page in a real browser (tests/support/browser_page.py drives it), against `python app.py` on the
tiny Captioner checkpoint: a drop zone for audio, no text prompt."""

from collections.abc import Iterator

import pytest
import soundfile

from browser_page import (
    ask, bot_texts, drop_file, message_box, open_settings, shown_messages, wait_for_metrics, wait_for_note,
)
from samples import clip
from served_app import ServedApp, served_app
from omni_local.protocol.kinds import CAPTIONER_TAKES_NO_TEXT
from omni_local.ui.history import AUDIO_SUFFIXES


@pytest.fixture(scope="module")
def served(demo_settings, captioner_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_captioner"), "--model", str(captioner_checkpoint),
                    "--speech", "false") as app:
        yield app


def test_typed_text_is_refused_saying_why_and_a_dropped_audio_file_is_then_captioned(page, shot, tmp_path):
    ask(page, "What is this sound?")
    wait_for_note(page, "Error", CAPTIONER_TAKES_NO_TEXT)
    shot("refused")
    assert shown_messages(page) == [("user", "What is this sound?"), ("bot", CAPTIONER_TAKES_NO_TEXT)]
    sound = tmp_path / "sound.wav"
    soundfile.write(sound, clip(5, 2.0), 16_000)
    drop_file(page, sound, "audio/wav")
    page.locator(".multimodal-textbox .thumbnail-item").wait_for()
    shot("dropped")
    page.get_by_role("button", name="Submit", exact=True).click()
    metrics = wait_for_metrics(page, 1)
    shot("captioned")
    caption = bot_texts(page)[1]
    assert caption and caption != metrics and "media: 1 encoded" in metrics  # the clip reached the model


def test_the_message_box_asks_for_an_audio_file_and_the_page_has_no_system_prompt_or_speech(page, shot):
    open_settings(page)
    shot("settings")
    assert "Qwen3-Omni Captioner" in page.locator("#omni-header").inner_text()
    assert message_box(page).get_attribute("placeholder") == "Drop an audio file here to caption it, or record one"
    accepted = page.locator(".multimodal-textbox input[type=file]").get_attribute("accept")
    assert {suffix.strip() for suffix in accepted.split(",")} == AUDIO_SUFFIXES  # what the file chooser offers
    assert not page.get_by_label("System prompt").is_visible() and page.get_by_label("Top-p").count()
    assert not page.get_by_text("Speak replies").is_visible() and not page.get_by_text("Voice conversation").count()
