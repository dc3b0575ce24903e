"""The chat page's layout beside what users of other chat apps expect, in a real browser
(tests/support/browser_page.py drives it), against `python app.py` on the demo model with speech on: a
visible, searchable list of chats; the app's settings in a panel of their own and none of Gradio's;
a readable context use; a hint in an empty chat; one line of metrics per reply, also on a phone;
plain titles; Rename and Delete only for a saved chat; the message box's placeholder kept. The
README's screenshot is taken here too."""

import re
from collections.abc import Iterator

import pytest

from browser_page import (
    DESKTOP, PHONE, answered_again, ask, choose_chat, listed_chats, message_box, new_chat, open_settings, search_chats,
    shown_title, wait_for_metrics, wait_until,
)
from served_app import ServedApp, served_app

MAX_CONTEXT_TOKENS = 8192  # the served app's, given on its command line
PLACEHOLDER = "Ask something, or drop an image, audio or video file here"  # layout.message_box's
SETTINGS = ["System prompt", "Longest reply (tokens)", "Temperature (0 is greedy)", "Top-p", "Speak replies", "Voice"]


@pytest.fixture(scope="module")
def served(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_layout"),
                    "--max-context-tokens", str(MAX_CONTEXT_TOKENS)) as app:
        yield app


def answered(page, question: str, replies: int = 1) -> None:
    ask(page, question)
    wait_for_metrics(page, replies)


def test_the_chats_are_a_visible_list_newest_first_with_the_shown_chat_highlighted(page, shot):
    answered(page, "Boats on the river")
    new_chat(page)
    answered(page, "Trains in the valley")
    shot("two-chats")
    assert listed_chats(page)[:2] == ["Trains in the valley", "Boats on the river"]
    assert shown_title(page) == "Trains in the valley"
    choose_chat(page, "Boats on the river")
    wait_until(page, lambda: shown_title(page) == "Boats on the river", "the chosen chat is not highlighted")
    highlighted = page.locator("#chat-list label.selected")
    assert highlighted.count() == 1 and highlighted.inner_text() == "Boats on the river"
    plain = page.locator("#chat-list label:not(.selected)").first
    assert highlighted.evaluate("(item) => getComputedStyle(item).backgroundColor") != plain.evaluate(
        "(item) => getComputedStyle(item).backgroundColor")  # drawn apart, not only checked
    shot("first-chosen")


def test_the_search_box_finds_chats_by_title_and_by_what_they_say(page, shot):
    answered(page, "Lighthouses of the northern coast and their keepers")
    answered(page, "Which one has a quokka painted on its door?", replies=2)
    new_chat(page)
    answered(page, "Recipes for marzipan cake")
    search_chats(page, "marzipan")
    shot("by-title")
    assert listed_chats(page) == ["Recipes for marzipan cake"]
    search_chats(page, "QUOKKA door")  # words of the second question, in no title
    shot("by-content")
    assert listed_chats(page) == ["Lighthouses of the northern coast and t…"]
    search_chats(page, "no chat says this")
    assert listed_chats(page) == []
    search_chats(page, "")
    assert {"Recipes for marzipan cake", "Lighthouses of the northern coast and t…"} <= set(listed_chats(page))


def test_the_apps_settings_are_in_a_labelled_panel_and_gradios_own_settings_are_not_on_the_page(page, shot):
    assert page.get_by_text("Additional inputs").count() == 0
    open_settings(page)
    shot("settings")
    panel = page.locator("#chat-settings")
    assert panel.get_by_text("Settings", exact=True).first.is_visible()
    for label in SETTINGS:
        assert panel.get_by_text(label, exact=True).first.is_visible(), label
    footer = page.locator("footer")
    assert footer.get_by_text("Settings").count() == 0
    assert footer.locator("button:visible, a:visible").evaluate_all(
        "(links) => links.map((link) => link.innerText.trim())") == ["Use via API"]


def test_the_context_use_is_a_bar_and_figures_in_body_text_beside_the_message_box(page, shot):
    answered(page, "How full is the context?")
    meter = page.locator("#context-use [role=meter]")
    meter.wait_for()
    shot("context")
    used = int(meter.get_attribute("aria-valuenow"))
    assert int(meter.get_attribute("aria-valuemax")) == MAX_CONTEXT_TOKENS and 0 < used < MAX_CONTEXT_TOKENS
    figures = page.locator("#context-use .figures")
    assert figures.inner_text() == f"Context: {used:,} of {MAX_CONTEXT_TOKENS:,} tokens"
    look = figures.evaluate("(text) => ({size: parseFloat(getComputedStyle(text).fontSize),"
                            "colour: getComputedStyle(text).color, body: getComputedStyle(document.body).color})")
    assert look["size"] >= 14 and look["colour"] == look["body"], look
    filled = page.locator("#context-use [role=meter] span").evaluate("(bar) => bar.style.width")
    assert filled == f"{100 * used / MAX_CONTEXT_TOKENS:.1f}%"
    box, context = message_box(page).bounding_box(), page.locator("#context-use").bounding_box()
    assert 0 <= context["y"] - (box["y"] + box["height"]) < 60  # right under the message box


def test_an_empty_chat_shows_what_can_be_done_in_it(page, shot):
    shot("empty")
    hint = page.locator(".empty-chat-hint")
    assert hint.is_visible()
    text = hint.inner_text()
    assert all(phrase in text for phrase in ["Type a question", "Drop images, audio or video", "Record a question",
                                            "Voice conversation"]), text
    assert page.get_by_text("Chatbot", exact=True).count() == 0  # no bare component label
    answered(page, "Hello")
    assert not hint.is_visible()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_each_replys_metrics_are_one_quiet_line_under_it(page, shot, open_tab, viewport):
    tab = page
    if viewport is PHONE:
        tab = open_tab(viewport)
        tab.get_by_role("button", name="Toggle Sidebar").click()
        new_chat(tab)
    answered(tab, "Measure this reply")
    metrics = tab.locator(".metrics-line .content p").last
    metrics.wait_for()
    shot("metrics", tab=tab)
    look = metrics.evaluate("""(line) => {
      const style = getComputedStyle(line);
      return {height: line.getBoundingClientRect().height, lineHeight: parseFloat(style.lineHeight),
              visible: line.checkVisibility(), size: parseFloat(style.fontSize), text: line.innerText};
    }""")
    assert look["visible"] and re.match(r"TTFT [\d.,]+ m?s", look["text"]), look
    assert look["height"] <= look["lineHeight"] + 1, look  # one line, whatever the width
    assert look["size"] <= 13, look
    group = tab.locator(".metrics-line").last.bounding_box()
    assert group["height"] <= look["lineHeight"] + 10, group  # no box, no title row around it


def test_a_title_written_in_markdown_is_listed_as_plain_text(page, shot):
    answered(page, "**Why** is `x` so _odd_?")
    shot("plain-title")
    wait_until(page, lambda: shown_title(page) == "Why is x so odd?", lambda: f"listed as {shown_title(page)!r}")


def test_rename_and_delete_are_disabled_until_the_chat_is_saved(page, shot):
    rename, delete = (page.get_by_role("button", name=name, exact=True) for name in ("Rename", "Delete"))
    shot("new-chat")
    assert rename.is_disabled() and delete.is_disabled()
    answered(page, "Keep me")
    wait_until(page, lambda: rename.is_enabled() and delete.is_enabled(), "Rename and Delete stay disabled")
    new_chat(page)
    wait_until(page, lambda: rename.is_disabled() and delete.is_disabled(), "Rename and Delete stay enabled")


def test_the_message_box_keeps_its_placeholder_after_a_question_is_sent(page, shot):
    box = message_box(page)
    assert box.get_attribute("placeholder") == PLACEHOLDER
    answered(page, "First question")
    shot("after-send")
    assert box.get_attribute("placeholder") == PLACEHOLDER
    answered_again(page, lambda: page.get_by_role("button", name="Retry").click())  # Gradio empties it there too
    assert box.get_attribute("placeholder") == PLACEHOLDER

