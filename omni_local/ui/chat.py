"""The chat UI: a Gradio 6 ChatInterface over the engine, a sidebar of saved chats, voice mode.

The page's parts are laid out in layout.py; this module answers messages and wires the parts'
events. How the shown chat becomes the model's conversation is history.py; saving and the
sidebar's actions are sidebar.py; spoken replies play through player.py; the voice conversation is
voice_mode.py. A chat is saved when its question is asked and as its reply streams, so a crash or a
reload loses nothing typed. Errors appear as a marked message in the chat, and the chat goes on.
"""

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline and private by default

import gradio as gr

from omni_local.access import page_principal
from omni_local.api import OmniLocal, Reply
from omni_local.errors import OmniLocalError, RequestError
from omni_local.folders import private_folder
from omni_local.protocol.events import AudioChunk, Finished, ReasoningDelta, TextDelta, Waiting
from omni_local.ui import sidebar
from omni_local.ui.access import upload_folder
from omni_local.ui.chats import ChatShelves, ChatStore
from omni_local.ui.history import (
    ChatMemory,
    as_dict,
    decoded_media,
    error_message,
    finished_reply,
    question,
    saved_streaming_reply,
    streaming_reply,
    to_messages,
    waiting_note,
)
from omni_local.ui.layout import CLOSE_SIDEBAR_ON_PHONES_JS, Page, context_use, lay_out
from omni_local.ui.messages import looks
from omni_local.ui.player import PLAYER_JS, audio_payload
from omni_local.ui.turn import Turn
from omni_local.ui.voice_mode import add_voice_mode

# Leaving a chat stops its reply as the stop button does (the button's own event cancels
# ChatInterface's): a reply still streaming would otherwise end in the chat the page shows next.
STOP_STREAMING_REPLY_JS = "() => { document.querySelector('.multimodal-textbox button.stop-button')?.click(); }"
# The page asks before Delete; the answer is the event's first input (an API client's is yes). A
# reply still streaming in the deleted chat stops.
CONFIRM_DELETE_JS = (
    "(yes, ...rest) => { const sure = confirm('Delete this chat?'); "
    "if (sure) document.querySelector('.multimodal-textbox button.stop-button')?.click(); return [sure, ...rest]; }"
)
# The tab's address names the chat it shows (?chat=<id>), so that a reload shows that chat, not the
# one changed last (in this tab or another); an address without one shows the latest.
SHOWN_CHAT_PARAMETER = "chat"
REMEMBER_SHOWN_CHAT_JS = (
    f"(id) => {{ const url = new URL(window.location.href); url.searchParams.set('{SHOWN_CHAT_PARAMETER}', id); "
    "window.history.replaceState(window.history.state, '', url); }"
)
# A streaming reply's text so far is saved every SAVE_EVERY_TOKENS tokens, or sooner once the
# setting ui_save_every_s has passed since the last save: a crash loses at most that much of it.
SAVE_EVERY_TOKENS = 16


class ChatTurns:
    """The chat's answers: each message asked in the engine, streamed to the page, saved."""

    def __init__(self, app: OmniLocal, shelves: ChatShelves, uploads: Path) -> None:
        self.app, self.shelves, self.uploads = app, shelves, uploads
        self.save_every_s = app.settings.ui_save_every_s
        # Session ids of the chats a typed reply is streaming into: voice mode leaves such a chat to the
        # reply's stream until it ends (voice_mode.py).
        self.typing: set[str] = set()

    def store(self, memory: ChatMemory, request: gr.Request | None) -> ChatStore:
        """The logged-in user's chats (the request says who; a page's memory keeps it for voice turns)."""
        memory.user = getattr(request, "username", None)
        return self.shelves.of(memory.user)

    def respond(self, message: dict[str, Any], history: list[dict[str, Any]], system_prompt: str,
                memory: ChatMemory, max_new_tokens: float, temperature: float, top_p: float, speak: bool,
                voice: str, request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """Yields updates (chat.py's `_update`): what the chat shows, the next audio chunk for the
        page's player, the context use, the list of chats."""
        store = self.store(memory, request)
        history = with_ended_turn(history, memory.turn)
        asked = [*history, question(message)]
        if not _save(store, asked, system_prompt, memory):  # the question is kept before it is answered
            yield _update(error_message(sidebar.CHANGED_ELSEWHERE))
            return
        listed = sidebar.chooser(store, memory.session_id)  # a new chat is in the list once asked
        try:
            session = self.app.session(system_prompt=system_prompt or None, session_id=memory.session_id,
                                       principal=page_principal(memory.user))
            if self.app.info.kind != "captioner":  # it captions each clip alone: earlier clips are not decoded again
                session.history += to_messages(history, self.app, memory)
            options = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p}
            if speak:
                options |= {"speak": True, "voice": voice}
            media = decoded_media(message.get("files") or [], self.app, memory)
            reply = session.send(message.get("text") or "", **media, **options)
        except OmniLocalError as error:
            _save(store, [*asked, as_dict(error_message(str(error)))], system_prompt, memory)
            yield _update(error_message(str(error)), chats=listed)
            return
        turn = memory.turn = Turn(reply, store, asked, system_prompt)
        self.typing.add(memory.session_id)
        try:
            yield from self._stream(turn, memory, listed)
        finally:
            self.typing.discard(memory.session_id)
            if not reply.done:  # the stop button (or leaving the chat) closed this generator
                reply.cancel()  # the engine stops too, and the reply's last event says where
                self._end(turn, memory, _last_event(reply))
            turn.ended.set()

    def _stream(self, turn: Turn, memory: ChatMemory, listed: Any) -> Iterator[tuple[Any, ...]]:
        """The turn's updates; the list of chats goes with the first (it holds the chat once asked)."""
        reasoning, text, chunks, unsaved, saved_at = "", "", 0, 0, time.monotonic()
        try:
            for event in turn.reply:
                if memory.left:  # its chat is no longer shown: the reply stops (in respond), saved in its own
                    return
                update: tuple[Any, ...] | None = None
                if isinstance(event, (ReasoningDelta, TextDelta)):
                    if isinstance(event, ReasoningDelta):
                        reasoning += event.text
                    else:
                        text += event.text
                    update = _update(streaming_reply(reasoning, text), chats=listed)
                    unsaved += 1
                    # Saved before the update is sent: a page that shows N tokens has them on disk.
                    if unsaved >= SAVE_EVERY_TOKENS or time.monotonic() - saved_at >= self.save_every_s:
                        _save(turn.store, [*turn.asked, *saved_streaming_reply(reasoning, text)], turn.system_prompt,
                              memory)
                        unsaved, saved_at = 0, time.monotonic()
                elif isinstance(event, Waiting):  # shown until the reply's first text takes its place
                    update = _update(waiting_note(event.ahead), chats=listed)
                elif isinstance(event, AudioChunk):
                    update = _update(streaming_reply(reasoning, text), audio=audio_payload(event, chunks), chats=listed)
                    chunks += 1
                elif isinstance(event, Finished):
                    update = _update(self._end(turn, memory, event), context=turn.context, chats=listed)
                if update is not None and not memory.left:  # the page may have opened another chat meanwhile
                    yield update
                    listed = None  # sent
        except OmniLocalError as error:
            _save(turn.store, [*turn.asked, as_dict(error_message(str(error)))], turn.system_prompt, memory)
            if not memory.left:
                yield _update(error_message(str(error)), chats=listed)

    def _end(self, turn: Turn, memory: ChatMemory, final: Finished | None) -> list[gr.ChatMessage]:
        """The ended turn's reply as shown and saved: its text, its speech and its metrics (which
        say a stopped reply was stopped); its token ids are kept for the next turn's prompt."""
        if final is None:  # it failed as it was stopped: what streamed is all there is
            return []
        reply = finished_reply(final, turn.reply.audio, self.uploads, memory)
        turn.shown = [*turn.asked, *map(as_dict, reply)]
        turn.stopped = final.stop_reason == "cancelled"
        tokens = final.context_used  # None where a remote server did not say (a stopped reply's never does)
        _save(turn.store, turn.shown, turn.system_prompt, memory, tokens)
        turn.context = context_use(self.app, tokens)
        return reply

    def stopped(self, memory: ChatMemory) -> tuple[Any, Any, Any]:
        """The stop button: the reply stops, and the page shows the chat as saved, its metrics
        marked stopped (ChatInterface's own stop only closes the reply's stream)."""
        turn = memory.turn
        if turn is None:
            return gr.skip(), gr.skip(), gr.skip()
        turn.stop()
        # Shown once, and only a stopped turn: stop is also pressed with nothing streaming (leaving a
        # chat does it), and a turn that ended on its own is already on the page.
        if not turn.stopped or memory.left:
            return gr.skip(), gr.skip(), gr.skip()
        turn.stopped = False
        return turn.shown, turn.shown, turn.context


def _save(store: ChatStore, history: list[dict[str, Any]], system_prompt: str, memory: ChatMemory,
          context_tokens: int | None = None) -> bool:
    """Save a turn's chat; False if another tab changed it since this page saw it."""
    try:
        sidebar.keep(store, history, system_prompt, memory, context_tokens)
        return True
    except sidebar.ChatChangedElsewhere:
        return False


def _update(chat: Any, audio: Any = None, context: Any = None, chats: Any = None) -> tuple[Any, ...]:
    """One update of the chat's outputs (ChatInterface's, then its additional ones: the player's
    feed, the context use, the list of chats); None leaves an output as it is."""
    return tuple(gr.skip() if value is None else value for value in (chat, audio, context, chats))


def with_ended_turn(history: list[dict[str, Any]], turn: Turn | None) -> list[dict[str, Any]]:
    """The page's chat with its last turn as this page saved it, if the page still shows that turn:
    a stopped reply's page copy can lack its "stopped" note, or the text the stream had not yet
    shown, and the saved form is what the reply's token ids (and the file) hold."""
    if turn is None or turn.shown is None:
        return history
    asked = len(turn.asked)
    answered = all(message.get("role") == "assistant" for message in history[asked:])
    return turn.shown if answered and list(map(looks, history[:asked])) == list(map(looks, turn.asked)) else history


def _last_event(reply: Reply) -> Finished | None:
    try:
        return reply.result()
    except RequestError:
        return None


def build_ui(app: OmniLocal, chats_folder: Path | None = None) -> gr.Blocks:
    """The chat page: the chat itself, a sidebar of saved chats (in `chats_folder`, by default
    `<cache_dir>/chats`; a folder of its own for each user with a login) and, when the app has the
    Talker, voice mode."""
    shelves = ChatShelves(chats_folder or app.settings.cache_path / "chats")
    uploads = private_folder(upload_folder(app.settings))
    voices = app.info.voices if app.info.speech else []
    turns = ChatTurns(app, shelves, uploads)
    page = lay_out(app, turns.respond, voices)
    with page.ui:
        _wire_chat(page, turns)
        _wire_sidebar(page, turns, uploads)
        if voices:
            def save_voice_turn(history: list[dict[str, Any]], system_prompt: str, memory: ChatMemory,
                                context_tokens: int | None) -> None:
                try:
                    sidebar.keep(shelves.of(memory.user), history, system_prompt, memory, context_tokens)
                except sidebar.ChatChangedElsewhere:
                    gr.Warning(sidebar.CHANGED_ELSEWHERE)

            def listed(shown: ChatMemory) -> Any:
                return sidebar.chooser(shelves.of(shown.user), shown.session_id)

            add_voice_mode(app, uploads, page.chat, page.audio_feed, page.memory, page.settings,
                           save=save_voice_turn, typing=turns.typing.__contains__, chats=(page.chooser, listed))
    # Each chat a reply of its own at once (Gradio's default is one event of a kind at a time, for every
    # user), as many as the API holds: beyond the chats the engine decodes together, they wait in the
    # engine's line, where each is told its place, not silently in Gradio's queue.
    page.ui.queue(default_concurrency_limit=max(app.info.concurrency, app.settings.api_max_requests))
    return page.ui


def _wire_chat(page: Page, turns: ChatTurns) -> None:
    """The chat's own events beyond ChatInterface's: speech to the player, stop, undo, clear."""
    chat = page.chat
    page.audio_feed.change(None, [page.audio_feed], None, js=PLAYER_JS)
    stop = chat.textbox.stop(turns.stopped, [page.memory], [chat.chatbot, chat.chatbot_state, page.context_use],
                             show_progress="hidden", api_name=False)
    # ChatInterface copies the page's chat into its own (the next turn's history) when the stopped
    # stream ends, from the page as it was then, which can land after the stopped chat above: copied
    # once more, after it.
    stop.then(lambda shown: shown, [chat.chatbot], [chat.chatbot_state], queue=False, show_progress="hidden",
              api_name=False)

    def undone(history: list[dict[str, Any]], system_prompt: str, shown_id: str, memory: ChatMemory,
               undo: gr.UndoData, request: gr.Request) -> tuple[Any, Any]:
        """The list of chats, and the context use of the turn the chat goes back to."""
        # The chat up to the undone question. The page may send the chat from before ChatInterface's
        # own undo or from after it (its handler runs first, unqueued): cutting at the index is right for both.
        index = undo.index[0] if isinstance(undo.index, (list, tuple)) else undo.index
        kept = history[:index]
        store = turns.store(memory, request)
        if not kept:
            return sidebar.clear(store, turns.uploads, memory), ""
        try:
            listed = sidebar.keep(store, kept, system_prompt, memory, shown_id=shown_id)
        except sidebar.ChatChangedElsewhere:
            gr.Warning(sidebar.CHANGED_ELSEWHERE)
            return gr.skip(), gr.skip()
        saved = store.get(memory.session_id)
        return listed, context_use(turns.app, saved.context_tokens) if saved else gr.skip()

    chat.chatbot.undo(undone, [chat.chatbot, page.system, page.shown_id, page.memory],
                      [page.chooser, page.context_use], show_progress="hidden", api_name=False)
    def cleared(memory: ChatMemory, request: gr.Request) -> tuple[Any, str]:
        return sidebar.clear(turns.store(memory, request), turns.uploads, memory), ""

    chat.chatbot.clear(cleared, [page.memory], [page.chooser, page.context_use], show_progress="hidden",
                       api_name=False)


def _wire_sidebar(page: Page, turns: ChatTurns, uploads: Path) -> None:
    """Open, new, delete, rename, and the page's start: each shows a chat of the logged-in user's."""
    chat = page.chat
    shown = [chat.chatbot, chat.chatbot_state, page.system, page.memory, page.chooser, page.title, page.context_use]

    def showing(view: tuple[Any, ...]) -> tuple[Any, ...]:
        *rest, tokens = view
        return (*rest, context_use(turns.app, tokens))

    def open_chat(chat_id: str, leaving: ChatMemory, request: gr.Request) -> tuple[Any, ...]:
        store = turns.store(leaving, request)
        return showing(sidebar.switch(store, store.get(chat_id), leaving))

    def new_chat(leaving: ChatMemory, request: gr.Request) -> tuple[Any, ...]:
        return showing(sidebar.switch(turns.store(leaving, request), None, leaving))

    def delete_chat(confirmed: bool, memory: ChatMemory, request: gr.Request) -> tuple[Any, ...]:
        if not confirmed:
            return tuple(gr.skip() for _ in shown)
        return showing(sidebar.delete(turns.store(memory, request), uploads, memory))

    def start(request: gr.Request) -> tuple[Any, ...]:
        """The chat the tab's address names (a chat of this user's; one not saved is a new chat), or
        for an address that names none, the latest."""
        user = getattr(request, "username", None)
        store = turns.shelves.of(user)
        named = request.query_params.get(SHOWN_CHAT_PARAMETER)
        return showing(sidebar.show(store, store.get(named) if named else store.latest(), user))

    def rename_chat(text: str, memory: ChatMemory, request: gr.Request) -> Any:
        return sidebar.rename(turns.store(memory, request), text, memory)

    confirmed = gr.Checkbox(value=True, visible=False)  # the page's answer to "Delete this chat?"
    opened = [
        page.chooser.input(open_chat, [page.chooser, page.memory], shown, api_name="open_chat"),
        page.new_chat.click(new_chat, [page.memory], shown, api_name="new_chat"),
        page.delete.click(delete_chat, [confirmed, page.memory], shown, api_name="delete_chat", js=CONFIRM_DELETE_JS),
        page.ui.load(start, None, shown, api_name=False),
    ]
    for event in opened:  # kept out of the API's outputs: an id the page needs, not the client
        event.then(lambda m: m.session_id, [page.memory], [page.shown_id], show_progress="hidden", api_name=False
                   ).then(None, [page.shown_id], None, js=REMEMBER_SHOWN_CHAT_JS, api_name=False)
    # A chosen chat is named in the address at once, before it is shown (a reload right after shows it).
    page.chooser.input(None, [page.chooser], None, js=REMEMBER_SHOWN_CHAT_JS, api_name=False)
    for leave in (page.chooser.input, page.new_chat.click):  # a reply still streaming stops
        leave(None, None, None, js=STOP_STREAMING_REPLY_JS, api_name=False)
    for narrow in (page.ui.load, page.new_chat.click):
        narrow(None, None, None, js=CLOSE_SIDEBAR_ON_PHONES_JS, api_name=False)
    page.rename.click(rename_chat, [page.title, page.memory], [page.chooser], api_name="rename_chat")

    def search_chats(query: str, memory: ChatMemory, request: gr.Request) -> dict[str, Any]:
        return {"query": query, "ids": sidebar.matching(turns.store(memory, request), query)}

    page.search.change(search_chats, [page.search, page.memory], [page.matches], trigger_mode="always_last",
                      show_progress="hidden", api_name=False)
