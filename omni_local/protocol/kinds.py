"""The members of the Qwen3-Omni family, and what each takes.

Qwen publishes three checkpoints of one architecture: Instruct (text, images, audio and video in;
text and speech out), Thinking (the same in, text out, reasoning before each answer; no Talker) and
the Captioner (one audio clip in, a detailed caption of it out; no text prompt, no Talker). The
Captioner is a single-turn model: each clip is captioned on its own, whatever came before it.
"""

from typing import Literal

import numpy as np

from omni_local.errors import RequestError
from omni_local.protocol.messages import Message

ModelKind = Literal["instruct", "thinking", "captioner"]
_TITLES: dict[ModelKind, str] = {"instruct": "Instruct", "thinking": "Thinking", "captioner": "Captioner"}

CAPTIONER_TAKES_NO_TEXT = ("the Captioner describes an audio clip on its own and takes no typed text: "
                           "drop an audio file alone to have it captioned")
CAPTIONER_TAKES_ONE_CLIP = "the Captioner takes one audio clip at a time, and no image or video"


def kind_title(kind: ModelKind) -> str:
    return f"Qwen3-Omni {_TITLES[kind]}"


def conversation_for(kind: ModelKind, messages: list[Message]) -> list[Message]:
    """What the model of `kind` is sent of `messages` (ending in a user turn): all of it, but for the
    Captioner only the last turn's clip, which must be all that turn holds (else a RequestError
    says why)."""
    if kind != "captioner":
        return messages
    question = messages[-1]
    if any(isinstance(part, str) for part in question.parts):
        raise RequestError(CAPTIONER_TAKES_NO_TEXT)
    clips = [p for p in question.parts if isinstance(p, np.ndarray)]
    if len(clips) != 1 or len(question.parts) != 1:
        raise RequestError(CAPTIONER_TAKES_ONE_CLIP)
    return [question]
