"""A typed turn of the chat page, below Gradio: asked, streamed, stopped, edited and saved
(ui/chat.py's ChatTurns on the shared demo app)."""

import inspect
import json
import math
import threading
from contextlib import closing

import pytest

from chats import written
from samples import picture
from omni_local.protocol.messages import reply_key
from omni_local.ui import sidebar
from omni_local.ui.chat import ChatTurns, with_ended_turn
from omni_local.ui.chats import ChatShelves
from omni_local.ui.edits import edited_question
from omni_local.ui.history import ChatMemory, to_messages
import omni_local.ui.chat as chat_module

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


def test_a_question_is_saved_as_soon_as_it_is_asked_before_any_reply(turns, monkeypatch):
    turns.save_every_s = math.inf  # no save while the reply streams
    monkeypatch.setattr(chat_module, "SAVE_EVERY_TOKENS", math.inf)
    memory = ChatMemory()
    with closing(turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)) as stream:
        next(stream)  # the reply's first text
        assert saved(turns, memory)["history"] == [{"role": "user", "content": ["Count to one thousand."]}]


def test_a_streaming_reply_is_saved_as_it_streams(turns):
    turns.save_every_s = 0.0  # each text delta's save is due
    memory = ChatMemory()
    with closing(turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)) as stream:
        for _ in range(3):
            shown = next(stream)[0]
        assert saved(turns, memory)["history"][1:] == [{"role": "assistant", "content": shown}]


def test_a_stopped_reply_is_saved_marked_stopped_and_its_tokens_are_reused_by_the_next_turn(turns):
    memory = ChatMemory()
    with closing(turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)) as stream:
        for _ in range(3):
            shown = next(stream)[0]
    # closing() is what the stop button does to the reply's stream.
    stopped = memory.turn.reply.result()
    chat = saved(turns, memory)["history"]
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant"]
    assert "stopped" in chat[-1]["content"] and chat[-1]["metadata"]["title"] == "Metrics"
    assert memory.turn.shown == chat  # what the stop button then shows on the page
    # The page may send the stopped turn back as far as it had streamed, without its note.
    page = [{"role": "user", "content": [{"type": "text", "text": "Count to one thousand."}]},
            {"role": "assistant", "content": inspect.cleandoc(shown)}]
    list(turns.respond({"text": "Go on.", "files": []}, page, memory=memory, **{**OPTIONS, "max_new_tokens": 4}))
    follow_up = memory.turn.reply.result()
    # The stopped reply was reused: all its tokens' KV (`written`, or one more where the cancel came
    # after the step of its last token was read); recomputing it would leave only its prompt's.
    assert follow_up.tokens.computed <= follow_up.tokens.prompt - written(stopped)
    assert saved(turns, memory)["history"][:3] == chat


def test_another_chat_is_shown_only_once_the_left_chats_streaming_reply_has_sent_its_last_update(turns):
    memory = ChatMemory()
    stream = turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)
    sent, page_ready = [], threading.Event()

    def gradio() -> None:  # iterates the reply's stream in a thread of its own, sending each update
        for update in stream:
            sent.append(update)
            page_ready.wait()

    thread = threading.Thread(target=gradio)
    thread.start()
    while not sent:  # the reply streams; its stream waits at a yield
        thread.join(0.01)
    threading.Timer(0.3, page_ready.set).start()
    sidebar.switch(turns.shelves.of(None), None, memory)
    assert memory.turn.ended.is_set(), "the new chat's view would be sent before the left chat's last update"
    thread.join(5)
    assert memory.turn.reply.result().stop_reason == "cancelled"


def test_an_edited_question_is_answered_with_its_files_and_saved_in_place_of_the_old_one(turns, tmp_path,
                                                                                        built_prompts):
    image = tmp_path / "house.png"
    picture(3).save(image)
    memory = ChatMemory()
    first = list(turns.respond({"text": "What is this?", "files": [str(image)]}, [], memory=memory,
                               **{**OPTIONS, "max_new_tokens": 4}))
    assert last_shown(first)
    # The pencil on the first question, as the page sends it back: Gradio gives the new text alone.
    asked = {"role": "user", "content": [{"type": "file", "file": {"path": str(image)}},
                                         {"type": "text", "text": "What is this?"}]}
    question = edited_question(asked, "What colour is it?")
    assert question == {"text": "What colour is it?", "files": [str(image)]}
    edited = list(turns.respond(question, [], memory=memory, **{**OPTIONS, "max_new_tokens": 4}))
    chat = saved(turns, memory)["history"]
    assert chat[0] == {"role": "user", "content": [{"path": str(image)}, "What colour is it?"]}
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant"] and chat[1:] == last_shown(edited)
    assert len(built_prompts[-1].media) == 1  # the picture was asked with the new text


def test_a_reply_with_whitespace_at_its_ends_keeps_its_token_ids_when_the_page_trims_it(app):
    memory = ChatMemory(replies={reply_key("  Hello there.\n"): [11, 12, 13]})
    page = [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Hello there.", "metadata": {}}]
    assert to_messages(page, app, memory)[1].token_ids == [11, 12, 13]


def test_a_reply_the_page_cleans_as_a_docstring_keeps_its_token_ids(app):
    made = "\tHello,\n\t  there.\n\n"
    memory = ChatMemory(replies={reply_key(made): [21, 22]})
    page = [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": inspect.cleandoc(made)}]
    assert to_messages(page, app, memory)[1].token_ids == [21, 22]


def test_the_next_turn_after_a_stop_reads_the_stopped_turn_as_saved_whatever_the_page_kept_of_it(turns):
    memory = ChatMemory()
    with closing(turns.respond({"text": "Count to one thousand.", "files": []}, [], memory=memory, **OPTIONS)) as stream:
        for _ in range(3):
            shown = next(stream)[0]
    # The page kept the question (in its own form) and the reply as far as it had streamed, no note.
    page = [{"role": "user", "content": [{"type": "text", "text": "Count to one thousand."}]},
            {"role": "assistant", "content": shown}]
    assert with_ended_turn(page, memory.turn) == memory.turn.shown == saved(turns, memory)["history"]
    edited = [{"role": "user", "content": [{"type": "text", "text": "Count to ten."}]}]  # the question edited
    assert with_ended_turn(edited, memory.turn) == edited
