"""The chat page in a real browser (tests/support/browser_page.py drives it), against `python app.py` on
the demo model with speech on."""

import json
import re
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from bad_files import media_error
from browser_page import (
    AUDIO_ELEMENTS_JS, METRICS, PHONE, answered_again, as_shown, ask, assert_each_chunk_played_as_it_came,
    assert_message_box_uncovered, bot_texts, chat_files, choose_chat, clear, delete_chat, drop_file,
    edit_last_question, edit_retry_and_undo, latest_saved, new_chat, play_spoken_reply_again, reload, rename,
    saved_chats, set_longest_reply, set_speak_replies, shown_messages, shown_title, stop, wait_for_answer,
    wait_for_metrics, wait_for_note, wait_for_reply_to_start, wait_for_streaming_recorder, wait_until,
    wait_until_saved_as_shown, watch_first_reply, window_chunks_in_order,
)
from served_app import ServedApp, served_app

MAX_CONTEXT_TOKENS = 8192  # the served app's, given on its command line
# The demo model's greedy reply to this, as a chat's first question, does not end on its own for
# thousands of tokens; nor does the next reply, when that one was cut short by the length limit.
ENDLESS_QUESTION = "Count to one thousand."
LONG_REPLY_TOKENS = 2000  # with ENDLESS_QUESTION, a reply of about 10 s, if nothing stopped it
FIRST_SOUND_LIMIT_S = 0.5


@pytest.fixture(scope="module")
def served(demo_settings, demo_checkpoint, tmp_path_factory) -> Iterator[ServedApp]:
    # An utterance is the speech and the pause around it: over the 2 s the other UI tests allow.
    with served_app(demo_settings, tmp_path_factory.mktemp("browser"), "--max-audio-seconds", "10",
                    "--max-context-tokens", str(MAX_CONTEXT_TOKENS)) as app:
        yield app


def test_a_question_sent_with_enter_gets_a_reply_that_streams_in(page, shot):
    set_longest_reply(page, 600)
    watch_first_reply(page)
    ask(page, ENDLESS_QUESTION)
    page.wait_for_function("() => window.omniLocalSeen.length >= 2")
    shot("streaming")
    wait_for_metrics(page, 1)
    shot("answered")
    seen = page.evaluate("window.omniLocalSeen")  # the reply's text each time it changed, before it ended
    final = bot_texts(page)[0]
    assert len(seen) >= 2, seen
    assert all(later.startswith(earlier) and len(later) > len(earlier) for earlier, later in zip(seen, seen[1:]))
    assert final.startswith(seen[-1]) and len(final) > len(seen[0])


def test_an_image_dropped_into_the_message_box_is_shown_and_answered(page, shot, tmp_path):
    picture = tmp_path / "blue-square.png"
    Image.new("RGB", (64, 48), (20, 40, 220)).save(picture)
    drop_file(page, picture, "image/png")
    page.locator(".multimodal-textbox .thumbnail-item img").wait_for()
    shot("dropped")
    ask(page, "What is in this picture?")
    metrics = wait_for_metrics(page, 1)
    shot("answered")
    encoded, from_cache = map(int, re.search(r"media: (\d+) encoded, (\d+) from the encoder cache", metrics).groups())
    assert encoded + from_cache == 1  # the picture reached the model
    assert bot_texts(page)[0]
    shown = page.locator("[data-testid=user] img").first
    assert "blue-square.png" in shown.get_attribute("src")
    assert shown.evaluate("(image) => image.complete && image.naturalWidth") == 64  # loaded, not a broken icon


def test_a_recorded_question_gets_a_spoken_reply_that_plays_as_it_streams_and_again_when_clicked(page, shot):
    set_speak_replies(page)
    page.get_by_role("button", name="Record audio").click()
    page.get_by_role("button", name="Start recording").click()
    page.wait_for_timeout(1500)  # the fake microphone plays speech.wav
    page.get_by_role("button", name="Stop recording").click()
    shot("recorded")
    page.get_by_role("button", name="Attach audio").click()
    shot("attached")
    page.get_by_role("button", name="Submit", exact=True).click()
    metrics = wait_for_metrics(page, 1)
    shot("answered")
    assert re.search(r"media: 1 encoded|media: 0 encoded, 1 from", metrics)  # the recording reached the model
    assert "s of speech" in metrics
    assert_each_chunk_played_as_it_came(page)
    play_spoken_reply_again(page)
    shot("playing-again")


def test_the_stop_button_stops_a_reply_and_the_next_question_is_answered(page, shot, served):
    set_longest_reply(page, LONG_REPLY_TOKENS)
    ask(page, ENDLESS_QUESTION)
    wait_for_reply_to_start(page, ENDLESS_QUESTION)
    page.wait_for_timeout(500)
    shot("streaming")
    note = stop(page)
    stopped = bot_texts(page)
    cpu_before = served.cpu_seconds()
    page.wait_for_timeout(2000)
    cpu_used = served.cpu_seconds() - cpu_before
    shot("stopped")
    assert bot_texts(page) == stopped and stopped[1:] == [note]  # the partial reply stays, marked, and no more
    assert cpu_used < 0.5, f"the app used {cpu_used:.2f} s of CPU in the 2 s after the stop: still generating"
    set_longest_reply(page, 24)
    asked = time.monotonic()
    ask(page, "Are you still there?")
    metrics = wait_for_answer(page)
    answered_s = time.monotonic() - asked
    shot("next-answered")
    assert answered_s < 15, f"the next reply took {answered_s:.1f} s"
    assert note in bot_texts(page), "the stopped reply's note went from the page when the next question was asked"
    cached, prompt = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) of ([\d,]+) prompt", metrics).groups())
    # The stopped reply's tokens are reused: the new question's own tokens (about 20) are computed.
    assert prompt - cached <= 32, f"the next turn computed the stopped reply again: {metrics}"


def test_a_reply_still_streaming_when_a_new_chat_is_opened_stays_out_of_it(page, shot, served):
    question = "Count to one thousand, and then on."  # its own question: this test's chats are told apart by it
    set_longest_reply(page, 600)  # a few seconds of reply
    ask(page, question)
    wait_for_reply_to_start(page, question)
    new_chat(page)
    page.wait_for_timeout(4000)  # long enough for the other chat's reply to have gone on, and ended
    shot("new-chat")
    assert shown_messages(page) == []  # none of the other chat's reply landed here
    saved = [json.loads(path.read_text()) for path in (served.cache_dir / "chats").glob("*.json")]
    assert sum(question in json.dumps(chat["history"][:1]) for chat in saved) == 1  # nor was saved as another chat


def test_switching_to_another_chat_and_back_keeps_each_chats_history(page, shot):
    ask(page, "First chat, about boats")
    wait_for_metrics(page, 1)
    first = shown_messages(page)
    new_chat(page)
    shot("new-chat")
    ask(page, "Second chat, about trains")
    wait_for_metrics(page, 1)
    second = shown_messages(page)
    shot("second-chat")
    choose_chat(page, "First chat, about boats")
    page.wait_for_function("(text) => document.querySelector('[data-testid=user]')?.innerText.includes(text)",
                           arg="First chat, about boats")
    shot("back-to-first")
    assert shown_messages(page) == first
    choose_chat(page, "Second chat, about trains")
    page.wait_for_function("(text) => document.querySelector('[data-testid=user]')?.innerText.includes(text)",
                           arg="Second chat, about trains")
    shot("back-to-second")
    assert shown_messages(page) == second


def test_a_reloaded_page_shows_the_chat_with_its_history(page, shot):
    ask(page, "Remember the lighthouse")
    wait_for_metrics(page, 1)
    ask(page, "And the keeper")
    wait_for_metrics(page, 2)
    before = shown_messages(page)
    shot("before-reload")
    page.reload()
    page.wait_for_function("(count) => document.querySelectorAll('[data-testid=user]').length === count",
                           arg=2)
    shot("after-reload")
    assert shown_messages(page) == before
    assert shown_title(page) == "Remember the lighthouse"


def test_a_corrupt_image_shows_its_error_in_the_chat_and_the_chat_goes_on(page, shot, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"these bytes are not an image\n" * 8)
    drop_file(page, broken, "image/png")
    page.locator(".multimodal-textbox .thumbnail-item").wait_for()
    shot("dropped")
    ask(page, "What is this?")
    error = page.locator("[data-testid=bot]").filter(has_text="Error")
    error.wait_for()
    shot("error")
    assert bot_texts(page) == [media_error(broken)]
    ask(page, "Are you still there?")
    wait_for_metrics(page, 1)
    shot("answered")
    texts = bot_texts(page)
    assert len(texts) == 3 and texts[1] and METRICS.search(texts[2])  # the error, a reply, its metrics


def test_a_spoken_reply_starts_to_sound_within_half_a_second_of_the_server_sending_it(page, shot, artifacts):
    set_speak_replies(page)
    ask(page, "Say something.")
    wait_for_metrics(page, 1)
    # Let the first chunk's scheduled start pass, so the output clock has covered it.
    page.wait_for_function("() => { const [first] = window.omniLocalStarts.filter((s) => s.context === "
                           "window.omniLocalPlayer?.context); return first && first.context.currentTime > "
                           "first.when + 0.2; }")
    shot("spoken")
    timing = page.evaluate("""() => {
      const [first] = window.omniLocalStarts.filter((s) => s.context === window.omniLocalPlayer.context);
      const output = first.context.getOutputTimestamp();  // a context time and when it left the device
      const heardAt = output.performanceTime + (first.when - output.contextTime) * 1000;
      return {arrived: window.omniLocalChunks[0].arrived, sounds: window.omniLocalChunks[0].sounds,
              index: window.omniLocalChunks[0].index, inPage: (heardAt - first.at) / 1000,
              outputLatency: first.context.outputLatency, baseLatency: first.context.baseLatency};
    }""")
    assert timing["index"] == 0
    heard = timing["arrived"] + timing["inPage"]  # server sent -> page had it -> out of the device
    report = (f"first spoken chunk, after the server sent it: reached the page {timing['arrived'] * 1000:.0f} ms, "
              f"scheduled to sound {timing['sounds'] * 1000:.0f} ms, out of the audio device {heard * 1000:.0f} ms "
              f"(AudioContext baseLatency {timing['baseLatency'] * 1000:.0f} ms, "
              f"outputLatency {timing['outputLatency'] * 1000:.0f} ms)")
    print(report)
    (artifacts / "latency.txt").write_text(report + "\n")
    assert 0 <= timing["sounds"] <= heard < FIRST_SOUND_LIMIT_S


def test_hands_free_voice_mode_answers_a_spoken_question_aloud_in_the_chat(page, shot):
    page.get_by_text("Voice conversation", exact=True).click()  # the section, not the empty chat's hint
    wait_for_streaming_recorder(page)
    microphone = page.locator("#voice-microphone")
    microphone.get_by_role("button", name="Record").click()  # hands-free is the default mode
    shot("listening")
    # The fake microphone's speech ends in a pause: the end of speech asks it, and the reply is
    # spoken through the page's player while its text streams into the chat.
    metrics = wait_for_metrics(page, 1)
    page.wait_for_function("() => (window.omniLocalChunks || []).length > 0")
    shot("answered")
    microphone.get_by_role("button", name="Stop").click()
    assert re.search(r"media: 1 encoded", metrics) and "s of speech" in metrics  # the utterance reached the model
    question = page.locator("[data-testid=user]").first
    assert question.evaluate(f"(root) => {{ {AUDIO_ELEMENTS_JS} return audioElements(root).length; }}") == 1
    assert window_chunks_in_order(page)


def test_one_chat_walked_through_every_action_is_saved_as_the_page_shows_it_after_each_step(page, shot, served):
    earlier = chat_files(served)

    def saved_as_shown(step: str) -> None:
        shot(step)
        wait_until_saved_as_shown(page, served, earlier)

    ask(page, ENDLESS_QUESTION)  # its reply cut at 24 tokens, mid-count
    wait_for_metrics(page, 1)
    saved_as_shown("asked")
    ask(page, "Walk: the second question")
    wait_for_metrics(page, 2)
    saved_as_shown("asked-again")
    edit_retry_and_undo(page, "Walk: the second question, edited", saved_as_shown)
    set_longest_reply(page, LONG_REPLY_TOKENS)
    ask(page, "Keep counting.")  # after the first reply, cut mid-count, the count goes on
    wait_for_reply_to_start(page, "Keep counting.")
    stop(page)
    saved_as_shown("stopped")
    set_longest_reply(page, 24)
    clear(page)
    saved_as_shown("cleared")  # no file: an empty chat is not kept
    ask(page, "Walk: after the clear")
    wait_for_metrics(page, 1)
    saved_as_shown("asked-after-clear")
    rename(page, "Walk, renamed")
    wait_until(page, lambda: [chat["title"] for chat in saved_chats(served, earlier)] == ["Walk, renamed"],
                lambda: f"the renamed chat was not saved with its title: {saved_chats(served, earlier)}")
    saved_as_shown("renamed")
    reload(page, served)
    saved_as_shown("reloaded")
    assert shown_title(page) == "Walk, renamed"
    assert delete_chat(page, accept=True) == "confirm: Delete this chat?"
    wait_until(page, lambda: "Walk, renamed" not in shown_title(page), "the deleted chat is still shown")
    shot("deleted")
    assert saved_chats(served, earlier) == []
    latest = latest_saved(served)
    assert shown_messages(page) == (as_shown(latest["history"]) if latest else [])  # the most recent other chat


def test_an_edited_question_gets_a_reply_and_the_chat_goes_on(page, shot, served):
    earlier = chat_files(served)
    ask(page, "Edit me: what is a lighthouse?")
    wait_for_metrics(page, 1)
    shot("asked")
    answered_again(page, lambda: edit_last_question(page, "Edited: what is a lighthouse keeper?"))
    shot("edited")
    ask(page, "And after the edit?")  # the message box works again
    wait_for_metrics(page, 2)
    shot("asked-after-edit")
    assert [text for who, text in shown_messages(page) if who == "user"] == [
        "Edited: what is a lighthouse keeper?", "And after the edit?"]
    wait_until_saved_as_shown(page, served, earlier)  # the edited question, and its reply


def test_opening_or_reloading_the_page_writes_no_file(page, shot, served, open_tab):
    earlier = chat_files(served)
    ask(page, "Reload me")
    wait_for_metrics(page, 1)
    wait_until_saved_as_shown(page, served, earlier)
    before = chat_files(served)
    for step in range(4):  # a copy was written on some loads only (about one in three)
        shot(f"opened-{step}", tab=open_tab())
        reload(page, served)
        shot(f"reloaded-{step}")
    page.wait_for_timeout(1000)  # a write the last load started would have landed by now
    assert chat_files(served) == before, "a page load wrote to the chats folder"


def test_a_renamed_chat_keeps_its_title_after_reloads(page, shot, served):
    ask(page, "Name me")
    wait_for_metrics(page, 1)
    rename(page, "The renamed chat")
    wait_until(page, lambda: shown_title(page) == "The renamed chat", "the list never showed the new title")
    for step in range(3):
        reload(page, served)
        shot(f"reloaded-{step}")
        assert shown_title(page) == "The renamed chat"
        assert [text for who, text in shown_messages(page) if who == "user"] == ["Name me"]


def test_a_cleared_chat_does_not_come_back_after_a_reload(page, shot, served):
    earlier = chat_files(served)
    question = "Clear me away"
    ask(page, question)
    wait_for_metrics(page, 1)
    wait_until_saved_as_shown(page, served, earlier)
    clear(page)
    shot("cleared")
    wait_until_saved_as_shown(page, served, earlier)  # its file is gone
    reload(page, served)
    shot("reloaded")
    assert all(question not in text for _, text in shown_messages(page))
    assert all(question not in json.dumps(chat["history"]) for chat in saved_chats(served))


def test_delete_asks_first_and_only_a_yes_deletes_the_chat(page, shot, served):
    earlier = chat_files(served)
    ask(page, "Delete me, if you are sure")
    wait_for_metrics(page, 1)
    wait_until_saved_as_shown(page, served, earlier)
    shown, saved = shown_messages(page), chat_files(served)
    assert delete_chat(page, accept=False) == "confirm: Delete this chat?"
    page.wait_for_timeout(1000)  # a delete would have reached the app and come back by now
    shot("kept")
    assert shown_messages(page) == shown and chat_files(served) == saved
    assert delete_chat(page, accept=True) == "confirm: Delete this chat?"
    wait_until(page, lambda: not saved_chats(served, earlier), "the deleted chat's file is still there")
    page.wait_for_function("(text) => ![...document.querySelectorAll('[data-testid=user]')].some("
                           "(message) => message.innerText.includes(text))", arg="Delete me, if you are sure")
    shot("deleted")


def test_on_a_phone_the_message_box_is_free_to_use_at_start_and_after_a_new_chat(page, shot, open_tab):
    phone = open_tab(PHONE)
    shot("start", tab=phone)
    assert_message_box_uncovered(phone)
    phone.get_by_role("button", name="Toggle Sidebar").click()
    new_chat(phone)
    shot("new-chat", tab=phone)
    assert_message_box_uncovered(phone)
    ask(phone, "Hello from a phone")
    wait_for_metrics(phone, 1)
    shot("answered", tab=phone)


def test_the_header_says_which_model_runs_and_that_speech_is_on(page, shot):
    header = page.locator("#omni-header")
    shot("header")
    assert "demo model: random weights, replies are noise" in header.inner_text()
    assert "speech on" in header.inner_text()


def test_the_context_use_shows_after_a_reply(page, shot):
    context_use = page.locator("#context-use")
    assert context_use.inner_text().strip() == ""  # a new chat
    ask(page, "How full is the context?")
    wait_for_metrics(page, 1)
    page.wait_for_function("(text) => document.querySelector('#context-use')?.innerText.includes(text)",
                           arg=f"of {MAX_CONTEXT_TOKENS:,} tokens")
    shot("answered")
    assert re.search(rf"Context: [\d,]+ of {MAX_CONTEXT_TOKENS:,} tokens", context_use.inner_text())


def test_a_new_chat_is_listed_by_its_first_question_once_asked(page, shot):
    ask(page, "List me, please")
    wait_for_metrics(page, 1)
    wait_until(page, lambda: shown_title(page) == "List me, please",
                lambda: f"the list shows {shown_title(page)!r} for the chat")
    shot("listed")


def test_a_two_line_first_question_is_titled_with_a_space_between_its_lines(page, shot, served):
    ask(page, "Two lines\nof question")
    wait_for_metrics(page, 1)
    reload(page, served)  # the page's start-up lists the saved chats, this one (the latest) chosen
    shot("titled")
    assert shown_title(page) == "Two lines of question"


def test_two_tabs_on_different_chats_stream_at_the_same_time(page, shot, open_tab):
    other = open_tab()
    new_chat(other)
    set_longest_reply(page, LONG_REPLY_TOKENS)
    ask(page, ENDLESS_QUESTION)
    wait_for_reply_to_start(page, ENDLESS_QUESTION)
    ask(other, "Are you there too?")
    wait_for_reply_to_start(other, "Are you there too?")
    shot("first-tab")
    shot("second-tab", tab=other)
    assert not any(map(METRICS.search, bot_texts(page))), "the first tab's reply had ended before the second's began"
    stop(page)
    wait_for_metrics(other, 1)


def test_a_chat_changed_in_another_tab_refuses_this_tabs_send_and_keeps_the_other_tabs_turn(page, shot, open_tab,
                                                                                              served):
    earlier = chat_files(served)
    ask(page, "Shared chat: the first question")
    wait_for_metrics(page, 1)
    other = open_tab()  # its start-up shows the most recent chat: this one
    other.wait_for_function("(text) => document.querySelector('[data-testid=user]')?.innerText.includes(text)",
                            arg="Shared chat: the first question")
    ask(page, "Shared chat: the first tab asks again")
    wait_for_metrics(page, 2)
    ask(other, "Shared chat: the second tab asks")
    refusal = wait_for_note(other, "Error", "another tab")
    shot("first-tab")
    shot("second-tab", tab=other)
    assert "chang" in refusal
    wait_until_saved_as_shown(page, served, earlier)  # the first tab's two turns, none lost
