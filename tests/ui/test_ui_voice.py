"""Voice mode in the page: the microphone's chunks, as the page uploads them, become turns of the
shown chat; speaking over a reply stops it; push-to-talk asks a whole recording; a voice turn is
cached like a typed one."""

import json
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import soundfile
import soxr

from omni_local.ui.sidebar import keep
from omni_local.ui.chats import ChatStore
from omni_local.ui.history import ChatMemory, to_messages
from omni_local.ui.player import STOP
from omni_local.ui.voice_mode import HANDS_FREE, PUSH_TO_TALK, TurnContext, VoiceMode
from samples import SILENCE, SPEECH
from waiting import until


def page_chunks(samples: np.ndarray, folder: Path) -> list[str]:
    """16 kHz audio as the page's microphone sends it: 100 ms WAV files at 48 kHz, 16-bit, each in a
    folder of its own (Gradio's upload layout)."""
    audio = soxr.resample(samples, 16_000, 48_000)
    paths = []
    for i, start in enumerate(range(0, len(audio), 4_800)):
        path = folder / f"chunk-{len(list(folder.glob('chunk-*')))}-{i}" / "audio.wav"
        path.parent.mkdir(parents=True)
        soundfile.write(path, audio[start : start + 4_800], 48_000, subtype="PCM_16")
        paths.append(str(path))
    return paths


@pytest.fixture
def chats(tmp_path) -> ChatStore:
    return ChatStore(tmp_path / "chats")


@pytest.fixture
def voice(speaking_app, chats, tmp_path) -> VoiceMode:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    return VoiceMode(speaking_app, uploads, lambda history, prompt, memory, tokens: keep(chats, history, prompt, memory,
                                                                                       tokens))


def asked_in(memory: ChatMemory, history: list | None = None, max_new_tokens: int = 6) -> TurnContext:
    options = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0, "voice": "Ethan"}
    return TurnContext(history or [], "", memory, options)


def speak(voice: VoiceMode, samples: np.ndarray, folder: Path, context: TurnContext, mode: str = HANDS_FREE) -> None:
    for chunk in page_chunks(samples, folder):
        voice.hear(chunk, mode, context)


def delivered(voice: VoiceMode, memory: ChatMemory, chat: list | None = None) -> tuple[list, list]:
    """What the timer brings the page showing `memory`'s chat (`chat`, at first) until voice mode has
    nothing more: player items, last chat."""
    items, chat = [], chat or []
    until(lambda: not voice.conversation.busy, "the voice turn did not end", 120)
    more = True
    while more:
        new_items, shown, _, more = voice.deliver(memory, chat)
        items += new_items if isinstance(new_items, list) else []
        chat = shown if isinstance(shown, list) else chat
    return items, chat


class Page:
    """A page showing `memory`'s chat: what it is given comes back as the browser sends it (through
    the Chatbot's round trip), and is saved at each change, as chat.py's page does."""

    def __init__(self, chats: ChatStore, memory: ChatMemory) -> None:
        self.chats, self.memory, self.chat = chats, memory, []
        with gr.Blocks():
            self.chatbot = gr.Chatbot()

    def show(self, chat: list) -> None:
        sent = json.loads(self.chatbot.postprocess(chat).model_dump_json())
        self.chat = self.chatbot.preprocess(self.chatbot.data_model(root=sent))
        keep(self.chats, self.chat, "", self.memory)

    def tick(self, voice: VoiceMode) -> bool:
        """One tick of voice mode's timer; whether it goes on ticking."""
        _, shown, _, more = voice.deliver(self.memory, self.chat)
        if isinstance(shown, list):
            self.show(shown)
        return more

    def ticks_until_voice_mode_is_done(self, voice: VoiceMode) -> None:
        until(lambda: not voice.conversation.busy, "the voice turn did not end", 120)
        for _ in range(100):
            if not self.tick(voice):
                return
        pytest.fail("voice mode's timer never stops")

    def shows(self) -> list[tuple[str, str]]:
        """(role, its title, "file" or its text) per message."""
        def look(message):
            title = (message.get("metadata") or {}).get("title")
            block = message["content"][0]
            return message["role"], title or ("file" if block["type"] == "file" else block["text"])
        return [look(message) for message in self.chat]


def saved_shows(chats: ChatStore, memory: ChatMemory) -> list[tuple[str, str]]:
    page = Page(chats, ChatMemory())
    page.chat = chats.get(memory.session_id).history
    return page.shows()


def typed_reply(page: Page, typing: set, question: str, parts: list[str], between=lambda: None) -> None:
    """A typed question and its reply streaming into the page as ChatInterface streams it: each
    update is the chat as it was when the question was sent, the question, and the reply so far."""
    asked_in = page.chat
    typed = {"role": "user", "content": [question]}
    page.show([*asked_in, typed])
    typing.add(page.memory.session_id)
    for end in range(1, len(parts) + 1):
        page.show([*asked_in, typed, {"role": "assistant", "content": "".join(parts[:end])}])
        between()
    page.show([*asked_in, typed, {"role": "assistant", "content": "".join(parts)},
               {"role": "assistant", "content": "[metrics]", "metadata": {"title": "Metrics"}}])
    typing.discard(page.memory.session_id)


def test_speech_then_a_second_of_silence_is_one_spoken_turn_of_the_shown_chat(voice, tmp_path):
    memory = ChatMemory()
    voice.start_recording(HANDS_FREE)
    speak(voice, np.concatenate([SILENCE, SPEECH, SILENCE]), tmp_path, asked_in(memory))
    voice.stop_recording(HANDS_FREE, asked_in(memory))
    items, chat = delivered(voice, memory)
    assert voice.conversation.turns == 1
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant", "assistant"]
    assert chat[0]["content"][0]["path"].endswith(".wav")  # the utterance, to play again
    assert [m["metadata"].get("title") for m in chat[1:]] == [None, "Spoken reply", "Metrics"]
    chunks = [item["index"] for item in items if "pcm" in item]
    assert chunks and chunks == list(range(len(chunks)))  # every chunk, in order
    assert not list(tmp_path.glob("chunk-*"))  # each chunk deleted once read, its folder once recording stops


def test_speaking_over_a_reply_stops_it_and_asks_again(voice, tmp_path):
    memory = ChatMemory()
    voice.start_recording(HANDS_FREE)
    speak(voice, np.concatenate([SPEECH, SILENCE]), tmp_path, asked_in(memory, max_new_tokens=200))
    until(lambda: voice._outbox, "the reply did not begin to play")
    first = voice.conversation.reply
    speak(voice, np.concatenate([SPEECH, SILENCE]), tmp_path, asked_in(memory, max_new_tokens=6))
    voice.stop_recording(HANDS_FREE, asked_in(memory))
    items, chat = delivered(voice, memory)
    assert voice.conversation.turns == 2 and first.result().stop_reason == "cancelled"
    # After the stop that speaking sent, only the new reply plays: its chunks from 0, none of the first's.
    after = items[len(items) - items[::-1].index(STOP):]
    assert after and [item["index"] for item in after] == list(range(len(after)))
    assert chat[-1]["metadata"]["title"] == "Metrics"


def test_push_to_talk_asks_the_whole_recording_and_a_new_recording_stops_the_reply(voice, tmp_path):
    memory = ChatMemory()
    voice.start_recording(PUSH_TO_TALK)
    speak(voice, SPEECH[:16_000], tmp_path, asked_in(memory), PUSH_TO_TALK)  # no pause needed
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory, max_new_tokens=200))
    assert voice.conversation.turns == 1
    until(lambda: voice._outbox, "the reply did not begin to play")
    first = voice.conversation.reply
    voice.start_recording(PUSH_TO_TALK)
    assert voice._outbox == [STOP]
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory))  # nothing recorded: nothing asked
    items, chat = delivered(voice, memory)
    assert first.result().stop_reason == "cancelled"
    assert voice.conversation.turns == 1 and [m["role"] for m in chat][:2] == ["user", "assistant"]


def test_a_typed_turn_after_a_voice_turn_computes_only_itself(voice, speaking_app, tmp_path):
    memory = ChatMemory()
    voice.start_recording(PUSH_TO_TALK)
    speak(voice, SPEECH, tmp_path, asked_in(memory), PUSH_TO_TALK)
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory))
    _, chat = delivered(voice, memory)
    # Read back from its file (a restart, a reload), the utterance is the very samples asked.
    spoken = to_messages(chat, speaking_app, ChatMemory())[0].parts[0]
    assert np.array_equal(spoken, memory.media[chat[0]["content"][0]["path"]])
    # The same two turns through the API, in a session of its own: each turn continues what the
    # one before computed.
    direct = speaking_app.session()
    direct.send(audio=[spoken], speak=True, max_new_tokens=6, temperature=0.0).result()
    expected = direct.send("And what else?", max_new_tokens=2).result().tokens
    assert expected.computed < expected.prompt / 3
    # The page's chat rebuilt into a prompt is that very prompt, token for token: all of it is found
    # in the cache (one token is always computed, for its logits).
    session = speaking_app.session(session_id=memory.session_id)
    session.history += to_messages(chat, speaking_app, memory)
    tokens = session.send("And what else?", max_new_tokens=2).result().tokens
    assert (tokens.prompt, tokens.computed) == (expected.prompt, 1)


def test_a_chunk_like_one_before_is_heard_again_though_its_file_is_gone(voice, tmp_path):
    """Gradio names an upload by its content: ten chunks of digital silence come to one path."""
    [chunk] = page_chunks(np.full(1_600, 0.1, np.float32), tmp_path)
    memory = ChatMemory()
    voice.start_recording(PUSH_TO_TALK)
    for _ in range(10):
        voice.hear(chunk, PUSH_TO_TALK, asked_in(memory))
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory))
    _, chat = delivered(voice, memory)
    heard = soundfile.info(chat[0]["content"][0]["path"]).frames
    assert 15_000 < heard <= 16_000  # all ten, 100 ms each (less what the resampler still holds)


def test_a_recording_the_disk_will_not_take_is_an_error_in_the_chat_and_voice_mode_goes_on(voice, tmp_path,
                                                                                           monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    memory = ChatMemory()
    chunks = page_chunks(SPEECH[:16_000], tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(soundfile, "write", full_disk)
        voice.start_recording(PUSH_TO_TALK)
        for chunk in chunks:
            voice.hear(chunk, PUSH_TO_TALK, asked_in(memory))
        voice.stop_recording(PUSH_TO_TALK, asked_in(memory))
    _, chat = delivered(voice, memory)
    assert [(m["role"], m["metadata"]["title"]) for m in chat] == [("assistant", "Error")]
    assert "the recording could not be kept (is the disk full?)" in chat[0]["content"]
    voice.start_recording(PUSH_TO_TALK)
    speak(voice, SPEECH[:16_000], tmp_path, asked_in(memory, chat), PUSH_TO_TALK)
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory, chat))
    _, chat = delivered(voice, memory, chat)  # the page shows the error
    assert [m["role"] for m in chat][:3] == ["assistant", "user", "assistant"]  # the error, then a turn
    assert chat[-1]["metadata"]["title"] == "Metrics"


def test_a_voice_turn_shows_only_in_its_own_chat_and_is_saved_there(voice, chats, tmp_path):
    """The page may switch chats while a voice reply is made: it must not land in the other chat,
    and its own chat, opened again, has it (the timer stops with voice mode: the turn saves itself)."""
    memory = ChatMemory()
    voice.start_recording(PUSH_TO_TALK)
    speak(voice, SPEECH[:16_000], tmp_path, asked_in(memory), PUSH_TO_TALK)
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory))
    _, shown_elsewhere = delivered(voice, ChatMemory())
    assert shown_elsewhere == []
    chat = chats.get(memory.session_id).history
    assert [m["role"] for m in chat][:2] == ["user", "assistant"] and chat[-1]["metadata"]["title"] == "Metrics"


@pytest.fixture
def voice_beside_typing(speaking_app, chats, tmp_path) -> tuple[VoiceMode, set[str], ChatMemory, Page]:
    """Voice mode told which chats a typed reply streams into (the set), a new chat, and its page."""
    uploads, typing = tmp_path / "uploads", set()
    uploads.mkdir()
    voice = VoiceMode(speaking_app, uploads, lambda history, prompt, m, tokens: keep(chats, history, prompt, m, tokens),
                      typing.__contains__)
    memory = ChatMemory()
    return voice, typing, memory, Page(chats, memory)


def test_a_question_typed_while_a_voice_reply_streams_stays_in_the_chat_with_both_replies_and_is_saved(
        voice_beside_typing, chats, tmp_path):
    voice, typing, memory, page = voice_beside_typing
    voice.start_recording(PUSH_TO_TALK)
    speak(voice, SPEECH[:16_000], tmp_path, asked_in(memory), PUSH_TO_TALK)
    voice.stop_recording(PUSH_TO_TALK, asked_in(memory, page.chat, max_new_tokens=200))
    until(lambda: voice._answer, "the voice reply's text did not stream")  # the text streams...
    page.tick(voice)
    assert voice.conversation.busy and [role for role, _ in page.shows()] == ["user", "assistant"]
    # ...while a typed question is sent and its reply streams, the timer ticking all along.
    typed_reply(page, typing, "And the sea?", ["Waves ", "and ", "tides."], between=lambda: page.tick(voice))
    assert voice.conversation.busy, "the voice reply ended before the typed one: nothing overlapped"
    page.ticks_until_voice_mode_is_done(voice)
    shown = page.shows()
    assert shown[0] == ("user", "file") and shown[2:4] == [("assistant", "Spoken reply"), ("assistant", "Metrics")]
    assert shown[4:] == [("user", "And the sea?"), ("assistant", "Waves and tides."), ("assistant", "Metrics")]
    assert saved_shows(chats, memory) == shown


def test_a_voice_question_asked_while_a_typed_reply_streams_follows_it_and_both_are_saved(voice_beside_typing, chats,
                                                                                          tmp_path):
    voice, typing, memory, page = voice_beside_typing

    def ask_by_voice_once():
        if voice.conversation.turns == 0:
            voice.start_recording(PUSH_TO_TALK)
            speak(voice, SPEECH[:16_000], tmp_path, asked_in(memory), PUSH_TO_TALK)
            voice.stop_recording(PUSH_TO_TALK, asked_in(memory, page.chat))
        until(lambda: voice._answer, "the voice reply's text did not stream")
        page.tick(voice)

    typed_reply(page, typing, "Boats?", ["Boats ", "float."], between=ask_by_voice_once)
    page.ticks_until_voice_mode_is_done(voice)
    shown = page.shows()
    assert shown[:3] == [("user", "Boats?"), ("assistant", "Boats float."), ("assistant", "Metrics")]
    assert shown[3] == ("user", "file") and shown[-1] == ("assistant", "Metrics")
    assert saved_shows(chats, memory) == shown
