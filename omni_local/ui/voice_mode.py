"""Voice conversation in the page: hands-free or push-to-talk, its turns in the shown chat.

The microphone streams to the server in 100 ms WAV chunks (Gradio's streaming Audio input). In
hands-free mode they go through voice.py's detector: the end of an utterance asks it, speech during
a reply stops it (barge-in). In push-to-talk mode the recording is the utterance: starting one stops
the reply, stopping it asks. A voice turn is a turn of the shown chat, in its cache session, like a
typed one: the utterance shows as an audio message, the reply's text streams under it and its audio
goes to the page's Web Audio player (player.py). Both come from the reply's streaming thread, not
from an event of the page, so a timer brings them to the page ten times a second while voice mode is
busy. A finished turn is saved into its own chat at once, whichever chat the page shows by then, and
the page's list of chats is brought with the next tick (a chat begun by voice is listed then).

The page's chat is also the typed turns': each tick puts the voice turn (its question and the replies
under it) in place in the chat as the page sends it, keeping what was typed meanwhile. A typed reply
streams its own copy of the chat, taken when it was asked, at each update: while one streams into the
voice turn's chat, ticks leave the chat alone, and the voice turn is put back once it ends.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import soundfile
import soxr

from omni_local.access import page_principal
from omni_local.api import AudioChunk, Finished, OmniLocal, Reply, TextDelta
from omni_local.errors import OmniLocalError, RequestError
from omni_local.media import SAMPLE_RATE
from omni_local.ui.chats import UTTERANCE_PREFIX
from omni_local.ui.history import (ChatMemory, as_dict, error_message, finished_reply, keep_wav, to_messages,
                                   waiting_note)
from omni_local.ui.messages import looks
from omni_local.ui.player import STOP, audio_payload
from omni_local.voice import VoiceConversation

HANDS_FREE, PUSH_TO_TALK = "Hands-free", "Push to talk"
CHUNK_SECONDS = 0.1  # how often the page sends the microphone's audio: the detector's reaction time
DELIVERY_SECONDS = 0.1  # how often the page fetches the reply's text and audio while it is made
HEARD_PATHS = 64  # chunk paths whose audio is kept, for a chunk arriving again
# Ticks that must see the page show a finished voice turn, with no typed reply streaming, before it is
# left to the page: a typed reply's last update can reach the page just after its stream has ended.
SETTLED_TICKS = 2


@dataclass
class TurnContext:
    """What a voice turn is asked in: the shown chat and the chat's settings, as the page has them."""

    history: list[dict[str, Any]] | None  # None: the chat as the timer last brought it
    system_prompt: str
    memory: ChatMemory
    options: dict[str, Any]  # Session.send's sampling options and voice


# Saves a chat: its messages, system prompt, memory and its last turn's context use, if counted
# (chat.py's save_voice_turn).
SaveChat = Callable[[list[dict[str, Any]], str, ChatMemory, int | None], object]
# The list of chats, for the page whose shown chat has this memory (chat.py's listed).
ListChats = Callable[[ChatMemory], Any]
# Whether a typed reply is streaming into the chat of this session id (chat.py's respond).
Typing = Callable[[str], bool]


class VoiceMode:
    """One page's voice conversation, between the page's events and the engine's reply thread."""

    def __init__(self, app: OmniLocal, uploads: Path, save: SaveChat,
                 typing: Typing = lambda session_id: False) -> None:
        self.app, self.uploads, self.save, self.typing = app, uploads, save, typing
        self.listening = False
        self._conversation: VoiceConversation | None = None  # made at first use: it loads the VAD
        self._context: TurnContext | None = None  # the chat as the page last sent it
        self._asked_in: TurnContext | None = None  # the chat the current voice turn was asked in
        # The microphone's events (start, chunks, stop) run on Gradio's worker threads, possibly at
        # once: one at a time, so a recording's state is never read while another event changes it.
        self._microphone = threading.Lock()
        self._resampler: soxr.ResampleStream | None = None  # one per recording: it carries state between chunks
        self._rate = 48_000  # the page's microphone rate, as its chunks say
        self._recording: list[np.ndarray] = []  # push-to-talk's utterance so far
        self._heard: OrderedDict[str, np.ndarray] = OrderedDict()  # recent chunk paths -> their audio
        self._folders: set[Path] = set()
        self._lock = threading.Lock()  # guards what follows: the reply thread writes, the timer reads
        self._outbox: list[dict[str, Any]] = []  # for the page's player
        self._question: dict[str, Any] | None = None  # the current voice turn's question
        self._answer: list[dict[str, Any]] = []  # its reply as shown so far
        self._finished = False  # its reply is all in _answer
        self._unsettled = 0  # ticks the page must still see the turn as made; 0: the page has it
        self._saved = False  # a turn was saved since the page last got the list of chats (it may be new there)
        self._page: tuple[str, list[dict[str, Any]]] = ("", [])  # the timer's last chat: session id, messages
        self._turn_chat: list[dict[str, Any]] = []  # the voice turn's chat as the page last showed it
        self._chunks = 0

    @property
    def conversation(self) -> VoiceConversation:
        if self._conversation is None:
            self._conversation = VoiceConversation(self._ask, self._play, self._stop_playing, show=self._show)
        return self._conversation

    # The page's events ------------------------------------------------------------------------

    def start_recording(self, mode: str) -> None:
        """The microphone is on; in push-to-talk a new utterance begins, which stops the reply."""
        with self._microphone:
            self.listening, self._resampler, self._recording = True, None, []
            self.conversation.detector.reset()  # an utterance the last recording cut off is not continued
            if mode == PUSH_TO_TALK:
                self.conversation.interrupt()

    def hear(self, chunk: str | None, mode: str, context: TurnContext) -> None:
        """The next stretch of the microphone (a WAV file the page uploaded)."""
        if chunk is None:
            return
        with self._microphone:
            samples = self._read(chunk)
            self._context = context
            if mode == HANDS_FREE:
                self.conversation.hear(samples)
            else:
                self._recording.append(samples)

    def stop_recording(self, mode: str, context: TurnContext) -> None:
        """The microphone is off; in push-to-talk the recording is asked."""
        with self._microphone:
            self._delete_folders()
            if mode == PUSH_TO_TALK and self._recording:
                self._context = context
                self.conversation.answer(np.concatenate(self._recording))
            self._recording = []
            self.listening = False  # after the answer is under way, so the timer goes on delivering it

    def deliver(self, shown: ChatMemory, page: list[dict[str, Any]] | None) -> tuple[Any, Any, bool, bool]:
        """What the page has not got yet: items for its player, and the chat with the voice turn as
        made so far (each gr.skip() if nothing is new; the chat also while a typed reply streams into
        it, or if the page now shows another chat than the turn's); whether a turn was saved since
        the last call (the list of chats may have changed); and whether voice mode still has work (so
        the timer keeps ticking). `page` is the chat as the page shows it now."""
        # Read before taking what is new: whatever the reply adds after this is taken next tick.
        more_to_come = self.listening or (self._conversation is not None and self._conversation.busy)
        page = list(page or [])
        with self._lock:
            items, self._outbox = self._outbox, []
            saved, self._saved = self._saved, False
            self._page = (shown.session_id, page)
            same_chat = self._asked_in is not None and self._asked_in.memory.session_id == shown.session_id
            if same_chat:
                self._turn_chat = page
            chat = gr.skip()
            if same_chat and self._unsettled and not self.typing(shown.session_id):
                merged = self._merged(page)
                if list(map(looks, merged)) != list(map(looks, page)):
                    # An error alone (no question was kept) has nothing to mark its place: shown once.
                    chat, self._unsettled = merged, SETTLED_TICKS if self._question is not None else 0
                elif self._finished:
                    self._unsettled -= 1
            # An unsettled turn of another chat is left to its save: the page reads the chat from there.
            more_to_come = more_to_come or (same_chat and self._unsettled > 0)
        return items or gr.skip(), chat, saved, more_to_come

    # The conversation's callbacks ---------------------------------------------------------------

    def _ask(self, samples: np.ndarray) -> Reply:
        """Ask an utterance in the shown chat's session, after the chat as the page has it."""
        context = self._context
        with self._lock:  # the timer never sees the new turn's chat with the last turn's messages
            session_id, page = self._page
            same_chat = session_id == context.memory.session_id
            history = context.history if context.history is not None else page if same_chat else []
            if self._unsettled and self._asked_in.memory.session_id == context.memory.session_id:
                history = self._merged(history)  # the last voice turn as made: the page may not have all of it
            self._asked_in, self._turn_chat = context, list(history)
            self._question, self._answer, self._finished, self._unsettled, self._chunks = None, [], False, 0, 0
        path = self._keep_utterance(samples)
        context.memory.remember(str(path), samples)  # the next turn's prompt holds exactly these samples
        with self._lock:
            self._question, self._unsettled = {"role": "user", "content": [{"path": str(path)}]}, SETTLED_TICKS
        session = self.app.session(system_prompt=context.system_prompt or None, session_id=context.memory.session_id,
                                   principal=page_principal(context.memory.user))
        session.history += to_messages(history, self.app, context.memory)
        return session.send(audio=[samples], speak=True, **context.options)

    def _play(self, chunk: AudioChunk) -> None:
        with self._lock:
            self._outbox.append(audio_payload(chunk, self._chunks))
            self._chunks += 1

    def _stop_playing(self) -> None:
        with self._lock:
            self._outbox = [STOP]  # chunks the page has not got yet are never played

    def _show(self, event: TextDelta | Finished | OmniLocalError) -> None:
        asked_in = self._asked_in  # the turn's own chat, whichever the page shows now
        if isinstance(event, TextDelta):
            text = (self._answer[0]["content"] if self._answer else "") + event.text
            answer = [{"role": "assistant", "content": text}]
        else:
            reply = self.conversation.reply
            shown = (finished_reply(event, reply.audio, self.uploads, asked_in.memory) if isinstance(event, Finished)
                     else [error_message(str(event))])
            answer = [as_dict(m) for m in shown]
            with self._lock:
                self._answer, self._finished, self._unsettled = answer, True, SETTLED_TICKS
                chat = self._merged(self._turn_chat)
            # Saved now, into its own chat as the page last showed it: the page may show another chat
            # by the time the turn ends, and the timer that brings turns to the page stops with voice mode.
            self.save(chat, asked_in.system_prompt, asked_in.memory,
                      event.context_used if isinstance(event, Finished) else None)
            with self._lock:
                self._saved = True
            return
        with self._lock:
            self._answer, self._unsettled = answer, SETTLED_TICKS

    def _merged(self, page: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`page` (the voice turn's chat, as the page showed it) with the voice turn as made so far in
        place of what it shows of it: the question and the replies under it, up to the next question.
        A page that does not show the question yet gets the turn at its end. Held: self._lock."""
        if self._question is None:  # no question yet, or none could be kept: only an error, at the end
            return [*page, *self._answer]
        name = looks(self._question)
        at = next((i for i, message in enumerate(page) if looks(message) == name), len(page))
        end = at + 1
        while end < len(page) and page[end]["role"] == "assistant":
            end += 1
        return [*page[:at], self._question, *(self._answer or self._waiting()), *page[end:]]

    def _waiting(self) -> list[dict[str, Any]]:
        """While the turn's reply waits for a seat, with nothing of it shown yet: a note of its place."""
        reply = self._conversation.reply if self._conversation is not None else None
        ahead = reply.waiting if reply is not None and not reply.done else 0
        return [{"role": "assistant", "content": waiting_note(ahead)}] if ahead else []

    # Audio ----------------------------------------------------------------------------------

    def _read(self, chunk: str) -> np.ndarray:
        """A chunk as 16 kHz mono float32. Each file is deleted once read: at ten a second they
        would fill the private folder. Gradio names an upload by its content, so a chunk like one
        before (digital silence) comes to a path already read, and maybe already deleted: its audio
        is known."""
        path = Path(chunk)
        audio = self._heard.get(chunk)
        if audio is None:
            try:
                data, rate = soundfile.read(path, dtype="float32", always_2d=True)
            except (OSError, soundfile.LibsndfileError):  # not a WAV the page made: nothing heard
                return np.zeros(0, np.float32)
            audio, self._rate = data.mean(axis=1), rate
            self._heard[chunk] = audio
            while len(self._heard) > HEARD_PATHS:
                self._heard.popitem(last=False)
        # The file only: removing its folder could race Gradio's upload of an identical chunk into it.
        path.unlink(missing_ok=True)
        self._folders.add(path.parent)
        if self._resampler is None:  # a new recording, at the page's rate
            self._resampler = soxr.ResampleStream(self._rate, SAMPLE_RATE, 1, dtype="float32")
        return self._resampler.resample_chunk(audio)

    def _delete_folders(self) -> None:
        """The chunks' emptied folders, once the microphone is off and nothing more comes to them."""
        for folder in self._folders:
            try:
                folder.rmdir()
            except OSError:  # not empty: some other upload lives there too
                pass
        self._folders.clear()

    def _keep_utterance(self, samples: np.ndarray) -> Path:
        """The utterance as a float WAV at 16 kHz in the private uploads folder: the chat shows it,
        and read back after a restart it gives the same samples, so the turn's cached KV matches."""
        try:
            return keep_wav(self.uploads, UTTERANCE_PREFIX, samples, SAMPLE_RATE, "FLOAT")
        except (OSError, RuntimeError) as error:
            raise RequestError(f"the recording could not be kept (is the disk full?): {error}") from None


def add_voice_mode(
    app: OmniLocal,
    uploads: Path,
    chat: gr.ChatInterface,
    audio_feed: gr.JSON,
    memory: gr.State,
    settings: list[gr.Component],
    save: SaveChat,
    typing: Typing,
    chats: tuple[gr.Component, ListChats],
) -> None:
    """The voice section under the chat. `memory` is the shown chat's; `settings` are the chat's own
    inputs a turn is asked with: system prompt, longest reply, temperature, top-p, voice; `save`
    saves a finished voice turn's chat; `typing` says whether a typed reply streams into a chat;
    `chats` is the list of chats and what it shows, given again once a voice turn is saved (a chat
    begun by voice is listed then)."""
    chat_list, listed = chats
    with gr.Accordion("Voice conversation", open=False):
        mode = gr.Radio([HANDS_FREE, PUSH_TO_TALK], value=HANDS_FREE, label="Mode",
                        info="Hands-free: speak, then pause; speaking over a reply stops it. "
                             "Push to talk: record, then stop to ask. Use headphones.")
        microphone = gr.Audio(sources=["microphone"], streaming=True, type="filepath", label="Microphone",
                              elem_id="voice-microphone")
    voice = gr.State(lambda: VoiceMode(app, uploads, save, typing))
    timer = gr.Timer(DELIVERY_SECONDS, active=False)

    def context(history: list[dict[str, Any]] | None, shown: ChatMemory, system_prompt: str, max_new_tokens: float,
                temperature: float, top_p: float, speaker: str) -> TurnContext:
        options = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p, "voice": speaker}
        return TurnContext(None if history is None else list(history), system_prompt, shown, options)

    def start(voice_mode: VoiceMode, chosen: str) -> gr.Timer:
        voice_mode.start_recording(chosen)
        return gr.Timer(active=True)

    def deliver(voice_mode: VoiceMode, shown: ChatMemory, page: list[dict[str, Any]]) -> tuple[Any, ...]:
        items, messages, saved, busy = voice_mode.deliver(shown, page)
        return items, messages, messages, listed(shown) if saved else gr.skip(), gr.skip() if busy else gr.Timer(active=False)

    quiet = {"show_progress": "hidden", "api_name": False}
    microphone.start_recording(start, [voice, mode], [timer], **quiet)
    # Ten chunks a second: without the chat, which the timer brings as often while the microphone is on.
    microphone.stream(lambda v, chunk, chosen, *c: v.hear(chunk, chosen, context(None, *c)),
                      [voice, microphone, mode, memory, *settings], None, stream_every=CHUNK_SECONDS,
                      time_limit=None, **quiet)
    microphone.stop_recording(lambda v, chosen, *c: v.stop_recording(chosen, context(*c)),
                              [voice, mode, chat.chatbot, memory, *settings], None, **quiet)
    timer.tick(deliver, [voice, memory, chat.chatbot], [audio_feed, chat.chatbot, chat.chatbot_state, chat_list, timer],
               **quiet)
