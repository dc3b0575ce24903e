"""The chat page's layout: a header naming the model; a sidebar with New chat, a search box, the
list of saved chats (the shown one highlighted), the shown chat's title, Rename and Delete, and the
app's settings; the chat, with a hint while it is empty, and the context use beside the message box.
What the parts do when used is wired in chat.py; the page's own look (CSS, and the script that keeps
the message box's placeholder and draws each reply's metrics as one line) is page_style.py."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from omni_local.api import OmniLocal
from omni_local.ui.chat_list import ChatList
from omni_local.ui.edits import ChatInterface
from omni_local.ui.history import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES, ChatMemory
from omni_local.ui.page_style import CHAT_LIST_ID, CLOSE_SIDEBAR_ON_PHONES_JS, CONTEXT_USE_HTML, FILTER_CHATS_JS


@dataclass(frozen=True)
class Page:
    ui: gr.Blocks
    chat: gr.ChatInterface
    memory: gr.State
    audio_feed: gr.JSON  # each spoken chunk as it comes; the page plays it at once (player.py)
    settings: list[gr.components.Component]  # system prompt, longest reply, temperature, top-p, voice
    speak: gr.Checkbox
    new_chat: gr.Button
    chooser: ChatList
    search: gr.Textbox
    matches: gr.JSON  # the search and the ids of the chats it finds (None: the list shows all)
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    shown_id: gr.Textbox  # the shown chat's id, on the page (see sidebar.keep)
    context_use: gr.HTML

    @property
    def system(self) -> gr.Textbox:
        return self.settings[0]


def lay_out(app: OmniLocal, respond: Callable, voices: list[str]) -> Page:
    """The page's parts, `respond` answering the chat's messages. The Captioner's page takes audio
    alone and has no system prompt (it captions each clip as it is); a checkpoint without a Talker
    has no speech settings."""
    captioner, talker = app.info.kind == "captioner", app.info.kind == "instruct"
    textbox = message_box(captioner)  # made outside the page: ChatInterface renders it in its place
    with gr.Blocks(title=f"omni_local · {app.info.model}", fill_height=True) as ui:
        gr.Markdown(header(app), elem_id="omni-header")
        memory = gr.State(ChatMemory())  # each page's own (ChatMemory.__deepcopy__)
        audio_feed = gr.JSON(visible=False)
        matches = gr.JSON(visible=False)
        with gr.Sidebar(label="Chats", open=True, elem_id="omni-sidebar"):
            new_chat = gr.Button("New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search chats", show_label=False, container=False, elem_id="chat-search")
            chooser = ChatList(choices=[], label="Chats", show_label=False, container=False, elem_id=CHAT_LIST_ID)
            # Enabled once the shown chat is saved (wire_layout).
            title = gr.Textbox(label="Title", show_label=False, placeholder="Rename this chat", container=False,
                               interactive=False, elem_id="chat-title")
            with gr.Row(elem_id="chat-actions"):
                rename = gr.Button("Rename", size="sm", interactive=False, min_width=60)
                delete = gr.Button("Delete", size="sm", variant="stop", interactive=False, min_width=60)
            # The chat's own inputs, which voice mode asks with too: rendered here, ChatInterface
            # takes them as they are (it shows only inputs not yet on the page, under "Additional inputs").
            with gr.Accordion("Settings", open=False, elem_id="chat-settings"):
                system = gr.Textbox(label="System prompt", lines=2, visible=not captioner)
                longest = gr.Slider(1, longest_reply(app), value=min(app.settings.max_new_tokens, longest_reply(app)),
                                    step=1, label="Longest reply (tokens)")
                temperature = gr.Slider(0.0, 2.0, value=app.settings.temperature, step=0.05,
                                        label="Temperature (0 is greedy)")
                top_p = gr.Slider(0.05, 1.0, value=app.settings.top_p, step=0.05, label="Top-p")
                speak = gr.Checkbox(value=False, interactive=bool(voices), visible=talker, label="Speak replies"
                                    if voices else "Speak replies (start the app with --speech true)")
                # An unknown voice is the engine's clear error, like any request's.
                voice = gr.Dropdown(voices, value=app.settings.voice, label="Voice", allow_custom_value=True,
                                    visible=talker)
        # Beside the message box; each reply updates it, so it is one of the chat's outputs.
        context_use = gr.HTML("", label="Context", elem_id="context-use", html_template=CONTEXT_USE_HTML,
                              js_on_load=None, render=False)
        chat = ChatInterface(  # edits.py: an edited question keeps its files, the box one dropped while a reply streams
            respond,
            multimodal=True,
            # One bubble a message: Gradio's edit of a bubble fails in the page on any block but text
            # (its pencil then does nothing), so a question's files show apart from its text.
            chatbot=gr.Chatbot(show_label=False, scale=1, placeholder=empty_chat_hint(captioner, bool(voices)),
                               elem_id="chat", group_consecutive_messages=False),
            textbox=textbox,
            additional_inputs=[system, memory, longest, temperature, top_p, speak, voice],
            additional_outputs=[audio_feed, context_use, chooser],
            editable=True,
            fill_height=True,
            # Gradio marks the outputs of a reply it cancels (the Stop button) "Error", with a Clear
            # button, when its cancel lands before the stopped reply's last update: after a Stop the
            # context line and the chats list read "Error". A reply's progress is its own streaming text.
            show_progress="hidden",
            api_name="chat",
        )
        context_use.render()
        shown_id = gr.Textbox(visible=False)
    page = Page(ui, chat, memory, audio_feed, [system, longest, temperature, top_p, voice], speak, new_chat, chooser,
                search, matches, title, rename, delete, shown_id, context_use)
    with ui:
        wire_layout(page)
    return page


def wire_layout(page: Page) -> None:
    """What the layout does alone: Rename and Delete (and the title) are enabled while the shown
    chat is saved; the list shows the chats the search found; on a phone, opening a chat closes
    the sidebar over it."""
    def saved(chosen: str | None) -> tuple[Any, ...]:
        return (gr.update(interactive=bool(chosen)),) * 3

    page.chooser.change(saved, [page.chooser], [page.title, page.rename, page.delete], queue=False,
                        show_progress="hidden", api_name=False)
    page.matches.change(None, [page.matches], None, js=FILTER_CHATS_JS, api_name=False)
    page.chooser.input(None, None, None, js=CLOSE_SIDEBAR_ON_PHONES_JS, api_name=False)


def message_box(captioner: bool) -> gr.MultimodalTextbox:
    """The box a question is asked in: text and files of every kind the model takes, or for the
    Captioner one audio clip (Gradio's box always takes typed text too: sent, it is refused saying why)."""
    if captioner:
        types, count, placeholder = AUDIO_SUFFIXES, "single", "Drop an audio file here to caption it, or record one"
    else:
        types, count = IMAGE_SUFFIXES | AUDIO_SUFFIXES | VIDEO_SUFFIXES, "multiple"
        placeholder = "Ask something, or drop an image, audio or video file here"
    return gr.MultimodalTextbox(
        file_types=sorted(types),
        file_count=count,
        sources=["upload", "microphone"],
        placeholder=placeholder,
        stop_btn=True,  # a custom textbox keeps its own (off by default): ChatInterface's is ignored
    )


def empty_chat_hint(captioner: bool, speech: bool) -> str:
    """What an empty chat shows: what can be done in it."""
    if captioner:
        ways = ["Drop an audio file on the box below, or attach one with the clip", "Or record one with the microphone"]
    else:
        ways = ["Type a question below and press Enter",
                "Drop images, audio or video files on the box, or attach them with the clip",
                "Record a question with the microphone"]
        if speech:
            ways.append("Talk hands-free in Voice conversation, under the box")
    items = "".join(f"<li>{way}</li>" for way in ways)
    heading = "Caption a sound" if captioner else "Start a chat"
    return f'<div class="empty-chat-hint"><h3>{heading}</h3><ul>{items}</ul></div>'


def header(app: OmniLocal) -> str:
    return f"**omni_local** · {app.info.describe()}"


def longest_reply(app: OmniLocal) -> int:
    """The longest reply the slider offers: what the context has room for after the longest prompt
    the app takes, so a reply of any length it offers fits."""
    info = app.info
    return max(1, info.max_context_tokens - info.max_prompt_tokens)


def context_use(app: OmniLocal, tokens: int | None) -> str:
    """"Context: 702 of 8,192 tokens", or nothing for a chat with no reply yet (or none counted)."""
    return f"Context: {tokens:,} of {app.info.max_context_tokens:,} tokens" if tokens else ""
