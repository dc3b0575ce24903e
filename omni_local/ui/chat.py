"""The chat UI: a Gradio 6 ChatInterface over the engine, a sidebar of saved chats, voice mode.

How the shown chat becomes the model's conversation is history.py; spoken replies play through
player.py; the voice conversation is voice_mode.py. Chats are saved as they change (chats.py) and
come back after a reload or a restart. Errors appear as a marked message in the chat, and the chat
goes on.
"""

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline and private by default

import gradio as gr

from omni_local.api import OmniLocal
from omni_local.cache.folders import private_folder
from omni_local.engine.request import AudioChunk, Finished, TextDelta
from omni_local.errors import OmniLocalError
from omni_local.ui.chats import ChatStore, SavedChat
from omni_local.ui.history import (
    AUDIO_SUFFIXES,
    IMAGE_SUFFIXES,
    REPLY_PREFIX,
    UTTERANCE_PREFIX,
    VIDEO_SUFFIXES,
    ChatMemory,
    as_dict,
    decoded_media,
    error_message,
    finished_reply,
    question,
    to_messages,
)
from omni_local.ui.messages import blocks, file_path
from omni_local.ui.player import PLAYER_JS, audio_payload
from omni_local.ui.voice_mode import add_voice_mode


# Leaving a chat stops its reply as the stop button does (the button's own event cancels
# ChatInterface's): a reply still streaming would otherwise end in the chat the page shows next.
STOP_STREAMING_REPLY_JS = "() => { document.querySelector('.multimodal-textbox button.stop-button')?.click(); }"


def build_ui(app: OmniLocal, store: ChatStore | None = None) -> gr.Blocks:
    """The chat page: the chat itself, a sidebar of saved chats (`store`, by default in
    `<cache_dir>/chats`) and, when the app has the Talker, voice mode."""
    store = store or ChatStore(app.settings.cache_path / "chats")
    uploads = private_folder(app.settings.cache_path / "uploads")
    voices = sorted(name.capitalize() for name in app.engine.speaker.runner.voices) if app.engine.speaker else []
    # Session ids of the chats a typed reply is streaming into: voice mode leaves such a chat to the
    # reply's stream until it ends (voice_mode.py).
    typing: set[str] = set()

    def respond(
        message: dict[str, Any],
        history: list[dict[str, Any]],
        system_prompt: str,
        memory: ChatMemory,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
        speak: bool,
        voice: str,
    ) -> Iterator[tuple[Any, Any]]:
        """Yields (what the chat shows, the next audio chunk for the page's player or gr.skip())."""
        try:
            session = app.session(system_prompt=system_prompt or None, session_id=memory.session_id)
            session.history += to_messages(history, app, memory)
            options = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p}
            if speak:
                options |= {"speak": True, "voice": voice}
            media = decoded_media(message.get("files") or [], app, memory)
            reply = session.send(message.get("text") or "", **media, **options)
        except OmniLocalError as error:
            yield error_message(str(error)), gr.skip()
            return
        text, chunks, update = "", 0, None
        typing.add(memory.session_id)
        try:
            for event in reply:
                if memory.left:  # its chat is no longer shown: the reply stops (finally, below), unsaved
                    return
                if isinstance(event, TextDelta):
                    text += event.text
                    update = text, gr.skip()
                elif isinstance(event, AudioChunk):
                    update = text, audio_payload(event, chunks)
                    chunks += 1
                elif isinstance(event, Finished):
                    shown = finished_reply(event, reply.audio, uploads, memory)
                    _keep(store, [*history, question(message), *map(as_dict, shown)], system_prompt, memory)
                    update = shown, gr.skip()
                if not memory.left:  # the page may have opened another chat meanwhile: not there
                    yield update
        except OmniLocalError as error:
            if not memory.left:
                yield error_message(str(error)), gr.skip()
        finally:
            typing.discard(memory.session_id)
            reply.cancel()  # the stop button closes this generator: stop the engine's work too

    textbox = gr.MultimodalTextbox(
        file_types=sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES),
        file_count="multiple",
        sources=["upload", "microphone"],
        placeholder="Ask something, or drop an image, audio or video file here",
        stop_btn=True,  # a custom textbox keeps its own (off by default): ChatInterface's is ignored
    )
    with gr.Blocks(title="omni_local") as ui:
        memory = gr.State(lambda: ChatMemory())
        # Each spoken chunk as it comes; the page plays it at once (Web Audio, below).
        audio_feed = gr.JSON(visible=False)
        # Rendered by ChatInterface, under "Additional inputs"; voice mode asks with them too.
        system = gr.Textbox(label="System prompt", lines=2, render=False)
        # A reply can use whatever the context leaves after the prompt.
        longest = gr.Slider(1, app.settings.max_context_tokens, value=app.settings.max_new_tokens, step=1,
                            label="Longest reply (tokens)", render=False)
        temperature = gr.Slider(0.0, 2.0, value=app.settings.temperature, step=0.05,
                                label="Temperature (0 is greedy)", render=False)
        top_p = gr.Slider(0.05, 1.0, value=app.settings.top_p, step=0.05, label="Top-p", render=False)
        speak = gr.Checkbox(value=False, render=False, interactive=bool(voices),
                            label="Speak replies" if voices else "Speak replies (start the app with --speech true)")
        # An unknown voice is the engine's clear error, like any request's.
        voice = gr.Dropdown(voices, value=app.settings.voice, label="Voice", allow_custom_value=True, render=False)
        with gr.Sidebar(label="Chats", open=True):
            new_chat = gr.Button("New chat", variant="primary")
            # Any saved chat's id is accepted (a page or API client opened before it was saved
            # has not been sent it as a choice); an unknown one opens a new chat.
            chooser = gr.Dropdown(label="Chats", choices=[], allow_custom_value=True)
            title = gr.Textbox(label="Title", placeholder="Rename this chat")
            with gr.Row():
                rename = gr.Button("Rename", size="sm")
                delete = gr.Button("Delete", size="sm", variant="stop")
        chat = gr.ChatInterface(
            respond,
            multimodal=True,
            textbox=textbox,
            additional_inputs=[system, memory, longest, temperature, top_p, speak, voice],
            additional_outputs=[audio_feed],
            title="omni_local",
            editable=True,
            api_name="chat",
        )
        if voices:
            add_voice_mode(app, uploads, chat, audio_feed, memory, [system, longest, temperature, top_p, voice],
                           save=partial(_keep, store), typing=typing.__contains__)
        # The shown chat's id, on the page: sent with the messages as the page had them when they
        # changed, while the memory is the server's, which may already be another chat's (see _keep).
        shown_id = gr.Textbox(visible=False)
        # The shown messages, and ChatInterface's own copy its API endpoint answers from.
        shown = [chat.chatbot, chat.chatbot_state, system, memory, chooser, title]
        audio_feed.change(None, [audio_feed], None, js=PLAYER_JS)
        chat.chatbot.change(lambda history, prompt, page_id, m: _keep(store, history, prompt, m, page_id),
                            [chat.chatbot, system, shown_id, memory], [chooser],
                            trigger_mode="always_last", show_progress="hidden", api_name=False)
        opened = [
            chooser.input(lambda chat_id, leaving: _switch(store, store.get(chat_id), leaving), [chooser, memory],
                          shown, api_name="open_chat"),
            new_chat.click(lambda leaving: _switch(store, None, leaving), [memory], shown, api_name="new_chat"),
            delete.click(lambda m: _delete(store, uploads, m), [memory], shown, api_name="delete_chat"),
            ui.load(lambda: _show(store, store.latest()), None, shown, api_name=False),
        ]
        for event in opened:  # kept out of the API's outputs: an id the page needs, not the client
            event.then(lambda m: m.session_id, [memory], [shown_id], show_progress="hidden", api_name=False)
        for leave in (chooser.input, new_chat.click, delete.click):  # a reply still streaming stops
            leave(None, None, None, js=STOP_STREAMING_REPLY_JS)
        rename.click(lambda text, m: _rename(store, text, m), [title, memory], [chooser], api_name="rename_chat")
    return ui


def _keep(store: ChatStore, history: list[dict[str, Any]], system_prompt: str, memory: ChatMemory,
          shown_id: str = "") -> Any:
    """Save the chat (not before its first question, nor once deleted): after each answer, and as
    the page changes it (undo, edit, a streamed update); the list then shows it first. `shown_id` is
    the chat the page showed with `history` ("" before the page has one): a change the page made
    before it opened another chat can arrive after the memory became the other chat's, and must not
    be saved as that chat."""
    if not history or memory.deleted or (shown_id and shown_id != memory.session_id):
        return gr.update()
    saved = store.get(memory.session_id) or SavedChat(id=memory.session_id)
    kept = (saved.history, saved.system_prompt, saved.replies)
    saved.history, saved.system_prompt, saved.replies = history, system_prompt or "", dict(memory.replies)
    # Unchanged when the page echoes an answer the chat already saved: no second write.
    if kept != (saved.history, saved.system_prompt, saved.replies):
        try:
            store.save(saved)
        except OSError as error:  # a full or read-only disk: the chat goes on, unsaved, and says so
            gr.Warning(f"This chat could not be saved: {error.strerror or error}")
    return _chooser(store, saved.id)


def _show(store: ChatStore, saved: SavedChat | None) -> tuple[Any, ...]:
    """The page for `saved`, or a new empty chat: its messages, system prompt, memory (its id is
    its cache session), the list and its title."""
    saved = saved or SavedChat()
    memory = ChatMemory(session_id=saved.id, replies=dict(saved.replies))
    return saved.history, saved.history, saved.system_prompt, memory, _chooser(store, saved.id), saved.title


def _switch(store: ChatStore, saved: SavedChat | None, leaving: ChatMemory) -> tuple[Any, ...]:
    """The page for `saved` (or a new chat), instead of the chat whose memory is `leaving`."""
    leaving.left = True
    return _show(store, saved)


def _rename(store: ChatStore, text: str, memory: ChatMemory) -> Any:
    saved = store.get(memory.session_id)
    if saved is not None:
        saved.title = text.strip()
        store.save(saved)
    return _chooser(store, memory.session_id)


def _delete(store: ChatStore, uploads: Path, memory: ChatMemory) -> tuple[Any, ...]:
    """Delete the shown chat, and the files the app wrote for it: its spoken replies and voice
    questions. Uploads stay: Gradio keeps one file per content, which other chats may show too."""
    saved = store.get(memory.session_id)
    for message in saved.history if saved else []:
        for block in blocks(message):
            path = Path(file_path(block) or "")
            if path.parent == uploads and path.name.startswith((REPLY_PREFIX, UTTERANCE_PREFIX)):
                path.unlink(missing_ok=True)
    store.delete(memory.session_id)
    memory.deleted = True  # a reply or voice turn still finishing does not save it again
    return _switch(store, store.latest(), memory)


def _chooser(store: ChatStore, selected: str) -> Any:
    choices = store.titles()
    return gr.update(choices=choices, value=selected if any(chat_id == selected for _, chat_id in choices) else None)
