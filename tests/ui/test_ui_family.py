"""The chat page on the Thinking and Captioner checkpoints, below Gradio (ui/chat.py's ChatTurns):
a reply's reasoning shown folded above its answer, saved, and given back to the model with the
reply's token ids; the Captioner's page, which takes one audio clip and refuses typed text."""

import inspect
import json
from contextlib import closing

import gradio as gr
import pytest
import soundfile

from samples import clip
from omni_local.api import OmniLocal
from omni_local.protocol.kinds import CAPTIONER_TAKES_NO_TEXT
from omni_local.protocol.messages import Message, reply_key
from omni_local.ui import sidebar
from omni_local.ui.chat import ChatTurns, build_ui
from omni_local.ui.chats import ChatShelves, ChatStore, SavedChat
from omni_local.ui.history import (
    AUDIO_SUFFIXES, ERROR_TITLE, REASONING_TITLE, ChatMemory, streaming_reply, to_messages,
)
from omni_local.ui.messages import block_text, blocks, file_path

QUESTION = "Why is the sky blue?"
LIMIT = 8  # reasoning tokens: the tiny model then answers (alone, it stops while reasoning)
OPTIONS = {"system_prompt": "", "max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "speak": False,
           "voice": "Ethan", "request": None}


@pytest.fixture(scope="module")
def answering(demo_settings, thinking_checkpoint):
    """The Thinking checkpoint with its reasoning ended after LIMIT tokens, so that it answers."""
    with OmniLocal(demo_settings.replace(model=str(thinking_checkpoint), max_reasoning_tokens=LIMIT)) as app:
        yield app


def chat_turns(app: OmniLocal, tmp_path) -> ChatTurns:
    uploads = tmp_path / "uploads"
    uploads.mkdir(exist_ok=True)
    return ChatTurns(app, ChatShelves(tmp_path / "chats"), uploads)


def saved(turns: ChatTurns, memory: ChatMemory) -> list[dict]:
    return json.loads((turns.shelves.of(None).folder / f"{memory.session_id}.json").read_text())["history"]


def as_the_page_sends(history: list[dict]) -> list[dict]:
    """A chat as the page sends it back: each message's content typed blocks, each text cleaned as
    Gradio's chatbot cleans it (inspect.cleandoc), the metadata as it was."""
    def block(item) -> dict:
        text = block_text(item)
        return {"type": "text", "text": inspect.cleandoc(text)} if text is not None else \
            {"type": "file", "file": {"path": file_path(item)}}

    return [{**message, "content": [block(item) for item in blocks(message)]} for message in history]


def titles(messages: list) -> list[str | None]:
    return [(m.metadata or {}).get("title") if isinstance(m, gr.ChatMessage) else None for m in messages]


def page_parts(app: OmniLocal, tmp_path) -> list:
    return list(build_ui(app, tmp_path / "chats").blocks.values())


# Thinking


def test_the_reasoning_streams_open_and_is_folded_above_the_answer_once_the_answer_begins(answering, tmp_path):
    memory = ChatMemory()
    shown = [update[0] for update in chat_turns(answering, tmp_path).respond(
        {"text": QUESTION, "files": []}, [], memory=memory, **OPTIONS)]
    final = memory.turn.reply.result()
    assert final.reasoning and final.text
    statuses = [messages[0].metadata["status"] for messages in shown[:-1]]
    answering_from = next(i for i, messages in enumerate(shown) if len(messages) == 2)
    assert statuses == ["pending"] * answering_from + ["done"] * (len(shown) - 1 - answering_from)
    assert all(titles(messages) == [REASONING_TITLE] for messages in shown[:answering_from])
    reasoning, answer, metrics = shown[-1]
    assert titles(shown[-1]) == [REASONING_TITLE, None, "Metrics"]
    assert reasoning.metadata["status"] == "done" and reasoning.content == final.reasoning
    assert answer.content == final.text


def test_a_thinking_chat_reopened_gives_turn_two_the_first_reply_with_its_reasoning_and_token_ids(answering,
                                                                                                 tmp_path):
    turns = chat_turns(answering, tmp_path)
    asking = ChatMemory()
    list(turns.respond({"text": QUESTION, "files": []}, [], memory=asking, **OPTIONS))
    first = asking.turn.reply.result()
    store = turns.shelves.of(None)
    # The chat opened again from the list, as after a restart: its page and memory come from its file.
    history, _, _, memory, *_ = sidebar.show(store, store.get(asking.session_id), None)
    page = as_the_page_sends(history)
    question, reply = to_messages(page, answering, memory)
    assert question == Message("user", [QUESTION])
    assert reply == Message("assistant", [inspect.cleandoc(first.text)], token_ids=first.token_ids,
                            reasoning=inspect.cleandoc(first.reasoning))
    list(turns.respond({"text": "And then?", "files": []}, page, memory=memory, **OPTIONS))
    second = memory.turn.reply.result()
    # Turn one's prompt up to the "<think>\n" its reply followed, which turn two's prompt leaves out.
    assert second.tokens.reused == first.tokens.prompt - 2
    chat = saved(turns, memory)
    assert [message.get("metadata", {}).get("title") for message in chat[:5]] == [
        None, REASONING_TITLE, None, "Metrics", None]
    assert chat[5]["metadata"]["title"] == REASONING_TITLE and chat[5]["content"] == second.reasoning


def test_two_replies_with_one_answer_but_other_reasoning_keep_their_own_token_ids(answering):
    memory = ChatMemory(replies={reply_key("Blue.", "Light scatters."): [1, 2], reply_key("Blue.", "I guess."): [3, 4]})
    page = [{"role": "user", "content": ["Why?"]},
            {"role": "assistant", "content": "I guess.", "metadata": {"title": REASONING_TITLE, "status": "done"}},
            {"role": "assistant", "content": "Blue."}]
    assert to_messages(page, answering, memory)[1].token_ids == [3, 4]


def test_a_reasoning_the_page_cleans_keeps_its_token_ids_through_a_saved_chat_and_blank_reasoning_is_none(
        answering, tmp_path):
    made = "\nOkay.\n  So, blue."  # Gradio's cleaning leaves the indentation in; cleaned again, it goes
    store = ChatStore(tmp_path / "chats")
    chat = SavedChat(replies={reply_key("Blue.", made): [5, 6], reply_key("Grey.", "\n\n"): [7]})
    store.save(chat)
    page = [{"role": "user", "content": ["Why?"]},
            {"role": "assistant", "content": inspect.cleandoc(made), "metadata": {"title": REASONING_TITLE}},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": ["And now?"]},
            {"role": "assistant", "content": "Grey."}]
    for replies in (chat.replies, store.get(chat.id).replies):  # as the chat was made, and opened again
        assert [m.token_ids for m in to_messages(page, answering, ChatMemory(replies=replies))[1::2]] == [[5, 6], [7]]
    assert streaming_reply("\n\n", "Grey.") == "Grey."  # and no blank "Reasoning" note is shown


def test_a_reply_stopped_while_reasoning_keeps_its_reasoning_shown_and_saved_for_the_next_turn(thinking, tmp_path):
    turns, memory = chat_turns(thinking, tmp_path), ChatMemory()
    question = {"text": "Count to ten.", "files": []}  # the tiny model reasons on for hundreds of tokens
    with closing(turns.respond(question, [], memory=memory, **{**OPTIONS, "max_new_tokens": 300})) as stream:
        for _ in range(3):
            next(stream)
    # closing() is what the stop button does to the reply's stream.
    stopped = memory.turn.reply.result()
    chat = saved(turns, memory)
    assert stopped.stop_reason == "cancelled" and stopped.text == "" and stopped.reasoning
    assert [m["metadata"].get("title") for m in chat[1:]] == [REASONING_TITLE, "Metrics"]
    assert chat[1]["content"] == stopped.reasoning and chat[1]["metadata"]["status"] == "done"
    assert memory.turn.shown == chat  # what the stop button then shows on the page
    (_, reply) = to_messages(as_the_page_sends(chat), thinking, memory)
    assert (reply.text, reply.reasoning, reply.token_ids) == ("", inspect.cleandoc(stopped.reasoning),
                                                             stopped.token_ids)


def test_a_checkpoint_without_a_talker_has_no_speech_settings_on_its_page(thinking, captioner, tmp_path):
    for app in (thinking, captioner):
        parts = page_parts(app, tmp_path)
        speech = [part for part in parts if isinstance(part, (gr.Checkbox, gr.Dropdown))
                  and part.label in ("Speak replies (start the app with --speech true)", "Voice")]
        assert len(speech) == 2 and not any(part.visible for part in speech)
        assert not [part for part in parts if isinstance(part, gr.Accordion) and part.label == "Voice conversation"]


# The Captioner


def test_the_captioners_message_box_takes_one_audio_file_and_its_page_has_no_system_prompt(captioner, tmp_path):
    parts = page_parts(captioner, tmp_path)
    (box,) = [part for part in parts if isinstance(part, gr.MultimodalTextbox)]
    assert sorted(box.file_types) == sorted(AUDIO_SUFFIXES) and box.file_count == "single"
    assert box.placeholder.startswith("Drop an audio file here to caption it")
    (system,) = [part for part in parts if isinstance(part, gr.Textbox) and part.label == "System prompt"]
    assert not system.visible


def test_text_typed_for_the_captioner_is_refused_saying_why_and_the_next_clip_is_captioned_on_its_own(
        captioner, tmp_path, built_prompts):
    turns, memory = chat_turns(captioner, tmp_path), ChatMemory()
    (refused,) = [update[0] for update in turns.respond({"text": "What is this?", "files": []}, [], memory=memory,
                                                         **OPTIONS)]
    assert (refused.content, refused.metadata["title"]) == (CAPTIONER_TAKES_NO_TEXT, ERROR_TITLE)
    chat = saved(turns, memory)
    assert chat == [{"role": "user", "content": ["What is this?"]},
                    {"role": "assistant", "content": CAPTIONER_TAKES_NO_TEXT, "metadata": {"title": ERROR_TITLE}}]
    sound = tmp_path / "sound.wav"
    soundfile.write(sound, clip(5, 2.0), 16_000)
    captions = []
    for _ in range(2):  # the same clip twice: the second is captioned as if it came alone
        list(turns.respond({"text": "", "files": [str(sound)]}, as_the_page_sends(chat), memory=memory, **OPTIONS))
        captions.append(memory.turn.reply.result())
        chat = saved(turns, memory)
        assert len(built_prompts[-1].media) == 1
    assert captions[0].text and captions[1].token_ids == captions[0].token_ids
    assert captions[1].tokens.prompt == captions[0].tokens.prompt
    assert [m["role"] for m in chat] == ["user", "assistant", *["user", "assistant", "assistant"] * 2]
