"""The chat page in a real browser (tests/support/browser_page.py drives it), against `python app.py` on the
tiny Thinking checkpoint, its reasoning ended after a few tokens so that it answers."""

import re
from collections.abc import Iterator

import pytest

from browser_page import (
    ask, chat_files, edit_retry_and_undo, open_settings, reload, shown_messages, wait_for_metrics,
    wait_until_saved_as_shown,
)
from served_app import ServedApp, served_app

# Run in the page: from now on, note whether a reply's reasoning was ever shown open.
WATCH_REASONING_OPEN_JS = """() => {
  window.omniLocalReasoningOpen = false;
  const look = () => {
    window.omniLocalReasoningOpen ||= [...document.querySelectorAll('[data-testid=bot] .title.expanded')].some(
      (title) => title.innerText.trim() === 'Reasoning');
  };
  new MutationObserver(look).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def served(demo_settings, thinking_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    with served_app(demo_settings, tmp_path_factory.mktemp("browser_thinking"), "--model", str(thinking_checkpoint),
                    "--speech", "false", "--max-reasoning-tokens", "8") as app:
        yield app


def reasoning_titles(page) -> list[bool]:
    """Whether each reply's reasoning is shown open, in the chat's order."""
    return page.locator("[data-testid=bot] .title").filter(has_text="Reasoning").evaluate_all(
        "(titles) => titles.map((title) => title.classList.contains('expanded'))")


def prompt_tokens(metrics: str) -> tuple[int, int]:
    """(from the cache, in the prompt) of a reply's metrics line."""
    reused, prompt = re.search(r"([\d,]+) of ([\d,]+) prompt tokens from cache", metrics).groups()
    return int(reused.replace(",", "")), int(prompt.replace(",", ""))


def test_the_reasoning_streams_open_is_folded_above_the_answer_and_turn_two_reuses_turn_one(page, shot, served):
    page.evaluate(WATCH_REASONING_OPEN_JS)
    ask(page, "Why is the sky blue?")
    first = wait_for_metrics(page, 1)
    shot("answered")
    assert page.evaluate("window.omniLocalReasoningOpen"), "the reasoning was never shown open as it streamed"
    assert reasoning_titles(page) == [False]
    (_, question), (_, reasoning), (_, answer), (_, metrics) = shown_messages(page)
    assert question == "Why is the sky blue?" and reasoning and answer and metrics == first
    ask(page, "And then?")
    second = wait_for_metrics(page, 2)
    shot("turn-two")
    (_, first_prompt), (reused, second_prompt) = prompt_tokens(first), prompt_tokens(second)
    # Turn two computes all but turn one's prompt up to its reply's "<think>\n" (2 tokens), which the
    # template leaves out with the reasoning.
    assert second_prompt - reused == second_prompt - (first_prompt - 2)
    shown = shown_messages(page)
    reload(page, served)  # the saved chat, shown again as it was: its reasoning kept, folded
    shot("reloaded")
    assert shown_messages(page) == shown
    assert reasoning_titles(page) == [False, False]  # both replies reasoned: the prompt opens the block


def test_edit_retry_and_undo_keep_each_reply_with_its_reasoning_folded_and_save_the_chat_as_shown(page, shot,
                                                                                                 served):
    earlier = chat_files(served)

    def saved_as_shown(step: str) -> None:
        shot(step)
        wait_until_saved_as_shown(page, served, earlier)
        assert reasoning_titles(page) == [False] * page.locator("[data-testid=user]").count()  # each reply's, folded

    ask(page, "Edit me: why is the sea blue?")
    wait_for_metrics(page, 1)
    ask(page, "And the sky?")
    wait_for_metrics(page, 2)
    saved_as_shown("asked")
    edit_retry_and_undo(page, "And the sky, edited?", saved_as_shown)


def test_the_header_names_the_thinking_checkpoint_and_the_page_offers_no_speech(page, shot):
    open_settings(page)
    shot("settings")
    assert "Qwen3-Omni Thinking" in page.locator("#omni-header").inner_text()
    assert page.get_by_label("System prompt").is_visible()
    assert not page.get_by_text("Speak replies").is_visible() and not page.get_by_text("Voice conversation").count()
