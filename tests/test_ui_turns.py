"""A typed turn of the chat page, below Gradio: asked, streamed, stopped, edited and saved
(ui/chat.py's ChatTurns on the shared demo app)."""

import inspect
import json

import pytest

from samples import picture
from omni_local.ui.chat import ChatTurns, with_ended_turn
from omni_local.ui.chats import ChatShelves
from omni_local.ui.history import ChatMemory, to_messages
from omni_local.ui.messages import reply_key

LONG = 200  # tokens: the demo's greedy replies to these questions do not end sooner
OPTIONS = {"system_prompt": "", "max_new_tokens": LONG, "temperature": 0.0, "top_p": 1.0, "speak": False,
           "voice": "Ethan", "request": None}


@pytest.fixture
def turns(app, tmp_path) -> ChatTurns:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    return ChatTurns(app, ChatShelves(tmp_path / "chats"), uploads)


def saved(turns: ChatTurns, memory: ChatMemory) -> dict:
    return json.loads((turns.shelves.of(None).folder / f"{memory.session_id}.json").read_text())


def last_shown(updates: list) -> list:
    """The chat's last update that was the whole reply (a list of messages), as dicts."""
    reply = next(update[0] for update in reversed(updates) if isinstance(update[0], list))
    return [{"role": "assistant", "content": m.content, "metadata": dict(m.metadata or {})} for m in reply]


def test_a_question_is_saved_as_soon_as_it_is_asked_before_any_reply(turns):
    memory = ChatMemory()
    stream = turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)
    next(stream)  # the reply's first text
    history = saved(turns, memory)["history"]
    assert history[0] == {"role": "user", "content": ["Count to one thousand."]}
    stream.close()


def test_a_stopped_reply_is_saved_marked_stopped_and_its_tokens_are_reused_by_the_next_turn(turns):
    memory = ChatMemory()
    stream = turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)
    for _ in range(3):
        next(stream)
    stream.close()  # what the stop button does to the reply's stream
    chat = saved(turns, memory)["history"]
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant"]
    assert "stopped" in chat[-1]["content"] and chat[-1]["metadata"]["title"] == "Metrics"
    assert memory.turn.shown == chat  # what the stop button then shows on the page
    follow_up = list(turns.respond({"text": "Go on.", "files": []}, chat, memory=memory,
                                   **{**OPTIONS, "max_new_tokens": 4}))
    metrics = last_shown(follow_up)[-1]["content"]
    prompt, cached = _prompt_and_cached(metrics)
    assert prompt - cached < 20, metrics  # only the new question was computed, not the stopped reply


def test_an_edited_question_is_answered_with_its_files_and_saved_in_place_of_the_old_one(turns, tmp_path):
    image = tmp_path / "house.png"
    picture(3).save(image)
    memory = ChatMemory()
    first = list(turns.respond({"text": "What is this?", "files": [str(image)]}, [], memory=memory,
                               **{**OPTIONS, "max_new_tokens": 4}))
    assert last_shown(first)
    # The pencil on the first question: Gradio sends the new text alone, and the history before it.
    edited = list(turns.respond("What colour is it?", [], memory=memory, **{**OPTIONS, "max_new_tokens": 4}))
    chat = saved(turns, memory)["history"]
    assert chat[0] == {"role": "user", "content": [{"path": str(image)}, "What colour is it?"]}
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant"] and chat[1:] == last_shown(edited)
    assert list(memory.media) == [str(image)]  # the picture was asked with the new text


def test_a_reply_with_whitespace_at_its_ends_keeps_its_token_ids_when_the_page_trims_it(app):
    memory = ChatMemory(replies={reply_key("  Hello there.\n"): [11, 12, 13]})
    page = [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Hello there.", "metadata": {}}]
    assert to_messages(page, app, memory)[1].token_ids == [11, 12, 13]


def _prompt_and_cached(metrics: str) -> tuple[int, int]:
    """Prompt tokens and those the cache supplied, from a metrics line of either format."""
    import re

    readable = re.search(r"([\d,]+) of ([\d,]+) prompt tokens from cache", metrics)
    if readable:
        return int(readable[2].replace(",", "")), int(readable[1].replace(",", ""))
    old = re.search(r"(\d+) prompt tokens: (\d+) computed", metrics)
    return int(old[1]), int(old[1]) - int(old[2])


def test_a_reply_the_page_cleans_as_a_docstring_keeps_its_token_ids(app):
    made = "\tHello,\n\t  there.\n\n"
    memory = ChatMemory(replies={reply_key(made): [21, 22]})
    page = [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": inspect.cleandoc(made)}]
    assert to_messages(page, app, memory)[1].token_ids == [21, 22]


def test_the_next_turn_after_a_stop_reads_the_stopped_turn_as_saved_whatever_the_page_kept_of_it(turns):
    memory = ChatMemory()
    stream = turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)
    for _ in range(3):
        shown = next(stream)[0]
    stream.close()
    # The page kept the question (in its own form) and the reply as far as it had streamed, no note.
    page = [{"role": "user", "content": [{"type": "text", "text": "Count to one thousand."}]},
            {"role": "assistant", "content": shown}]
    assert with_ended_turn(page, memory.turn) == memory.turn.shown == saved(turns, memory)["history"]
    edited = page[:0]  # an edit or an undo took the turn away: the page's chat is kept as it is
    assert with_ended_turn(edited, memory.turn) == edited
