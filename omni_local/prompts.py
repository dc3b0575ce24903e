"""A conversation, and how it becomes the Thinker's inputs through the checkpoint's own chat template."""

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from omni_local.errors import RequestError

Role = Literal["system", "user", "assistant"]
Part = str | Image.Image | np.ndarray  # text, an RGB image, or 16 kHz mono float32 samples


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    def template_content(self) -> list[dict[str, Any]]:
        """Content blocks as chat templates expect them; media are placeholders the processor expands."""
        blocks: list[dict[str, Any]] = []
        for part in self.parts:
            if isinstance(part, str):
                blocks.append({"type": "text", "text": part})
            elif isinstance(part, Image.Image):
                blocks.append({"type": "image"})
            else:
                blocks.append({"type": "audio"})
        return blocks

    def images(self) -> list[Image.Image]:
        return [p for p in self.parts if isinstance(p, Image.Image)]

    def audios(self) -> list[np.ndarray]:
        return [p for p in self.parts if isinstance(p, np.ndarray)]


@dataclass
class Prompt:
    """Everything the Thinker needs for one request's prompt (tensors on the CPU)."""

    input_ids: torch.Tensor  # [1, L]
    pixel_values: torch.Tensor | None = None  # [patches, C*T*P*P], all images together
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    input_features: torch.Tensor | None = None  # [clips, mel, frames]
    feature_attention_mask: torch.Tensor | None = None  # [clips, frames]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def audio_feature_lengths(self) -> torch.Tensor | None:
        if self.feature_attention_mask is None:
            return None
        return self.feature_attention_mask.sum(-1)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments transformers' own Thinker takes (used by the parity reference)."""
        inputs = {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids)}
        for name in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"):
            if getattr(self, name) is not None:
                inputs[name] = getattr(self, name)
        return inputs


def render_conversation(messages: list[Message], processor: Any) -> str:
    chat = [{"role": m.role, "content": m.template_content()} for m in messages]
    return processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def build_prompt(messages: list[Message], processor: Any) -> Prompt:
    """Tokenize a conversation ending in a user turn, with its images and clips in order."""
    text = render_conversation(messages, processor)
    images = [image for m in messages for image in m.images()]
    audios = [clip for m in messages for clip in m.audios()]
    try:
        encoded = processor(text=[text], images=images or None, audio=audios or None, return_tensors="pt")
    except ValueError as error:  # e.g. an image too thin to cut into patches
        raise RequestError(f"this input cannot be prepared for the model: {error}") from None
    return Prompt(
        input_ids=encoded["input_ids"],
        pixel_values=encoded.get("pixel_values"),
        image_grid_thw=encoded.get("image_grid_thw"),
        input_features=encoded.get("input_features"),
        feature_attention_mask=encoded.get("feature_attention_mask"),
    )
