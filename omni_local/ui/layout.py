"""The chat page's layout: a header naming the model, the sidebar of saved chats, the chat with its
settings, and the context use under it. What the parts do when used is wired in chat.py."""

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from omni_local.api import OmniLocal
from omni_local.ui.edits import ChatInterface
from omni_local.ui.history import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES, ChatMemory

# The page fills the window: the chat takes the height the header and context line leave.
PAGE_CSS = """
#omni-header p { margin: 0; }
#context-use p { margin: 0; font-size: var(--text-sm); color: var(--body-text-color-subdued); }
"""
# Phone-sized windows: Gradio opens the sidebar over the chat; it starts closed there, as after
# "New chat" (the same script), so the message box is usable without closing anything first.
PHONE_WIDTH_PX = 768
CLOSE_SIDEBAR_ON_PHONES_JS = (
    f"() => {{ if (window.innerWidth < {PHONE_WIDTH_PX}) "
    "document.querySelector('.sidebar.open .toggle-button')?.click(); }"
)


@dataclass(frozen=True)
class Page:
    ui: gr.Blocks
    chat: gr.ChatInterface
    memory: gr.State
    audio_feed: gr.JSON  # each spoken chunk as it comes; the page plays it at once (player.py)
    settings: list[gr.components.Component]  # system prompt, longest reply, temperature, top-p, voice
    speak: gr.Checkbox
    new_chat: gr.Button
    chooser: gr.Dropdown
    title: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    shown_id: gr.Textbox  # the shown chat's id, on the page (see sidebar.keep)
    context_use: gr.Markdown

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
        # Rendered by ChatInterface, under "Additional inputs"; voice mode asks with them too.
        system = gr.Textbox(label="System prompt", lines=2, visible=not captioner, render=False)
        longest = gr.Slider(1, longest_reply(app), value=min(app.settings.max_new_tokens, longest_reply(app)), step=1,
                            label="Longest reply (tokens)", render=False)
        temperature = gr.Slider(0.0, 2.0, value=app.settings.temperature, step=0.05,
                                label="Temperature (0 is greedy)", render=False)
        top_p = gr.Slider(0.05, 1.0, value=app.settings.top_p, step=0.05, label="Top-p", render=False)
        speak = gr.Checkbox(value=False, render=False, interactive=bool(voices), visible=talker,
                            label="Speak replies" if voices else "Speak replies (start the app with --speech true)")
        # An unknown voice is the engine's clear error, like any request's.
        voice = gr.Dropdown(voices, value=app.settings.voice, label="Voice", allow_custom_value=True, visible=talker,
                            render=False)
        # Under the chat; each reply updates it, so it is one of the chat's outputs.
        context_use = gr.Markdown("", label="Context", elem_id="context-use", render=False)
        with gr.Sidebar(label="Chats", open=True):
            new_chat = gr.Button("New chat", variant="primary")
            # Any saved chat's id is accepted (a page or API client opened before it was saved
            # has not been sent it as a choice); an unknown one opens a new chat.
            chooser = gr.Dropdown(label="Chats", choices=[], allow_custom_value=True)
            title = gr.Textbox(label="Title", placeholder="Rename this chat")
            with gr.Row():
                rename = gr.Button("Rename", size="sm")
                delete = gr.Button("Delete", size="sm", variant="stop")
        chat = ChatInterface(  # edits.py: an edited question keeps its files
            respond,
            multimodal=True,
            # One bubble a message: Gradio's edit of a bubble fails in the page on any block but text
            # (its pencil then does nothing), so a question's files show apart from its text.
            chatbot=gr.Chatbot(group_consecutive_messages=False),
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
    return Page(ui, chat, memory, audio_feed, [system, longest, temperature, top_p, voice], speak, new_chat, chooser,
                title, rename, delete, shown_id, context_use)


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
