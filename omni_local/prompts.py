"""A conversation, and how it becomes the Thinker's tokens through the checkpoint's own chat template.

Building a prompt does no image resizing and no feature extraction: placeholder counts and M-RoPE
grids follow from each medium's size alone. Pixels and mel features are made later, and only for
the media the prefix cache could not supply (`preprocess`).
"""

import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

from omni_local.cache.digests import media_digest, token_keys
from omni_local.errors import RequestError

Role = Literal["system", "user", "assistant"]
Part = str | Image.Image | np.ndarray  # text, an RGB image, or 16 kHz mono float32 samples



@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)
    # A reply's tokens as the model made them: the next prompt reuses them as they are, so the
    # reply's cached KV stays valid (decoding and re-tokenizing could give other ids).
    token_ids: list[int] | None = None

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    def images(self) -> list[Image.Image]:
        return [p for p in self.parts if isinstance(p, Image.Image)]

    def audios(self) -> list[np.ndarray]:
        return [p for p in self.parts if isinstance(p, np.ndarray)]


@dataclass(frozen=True)
class MediaItem:
    """One image or clip of a prompt and the run of placeholder tokens that stands for it."""

    part: Image.Image | np.ndarray
    digest: bytes  # of the decoded content: the cache's key for it
    start: int  # index of its first placeholder token
    length: int  # placeholder tokens
    grid: tuple[int, int, int] | None = None  # images: (t, h, w) in patches
    frames: int | None = None  # audio: mel frames

    @property
    def is_image(self) -> bool:
        return self.grid is not None

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class Prompt:
    """A prompt's tokens, its media, and each token's cache key (tensors on the CPU)."""

    input_ids: torch.Tensor  # [1, L]
    media: list[MediaItem]
    keys: np.ndarray  # [L] int64: a text token's id, or a media token's key from its digest

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        grids = [m.grid for m in self.media if m.is_image]
        return torch.tensor(grids, dtype=torch.long) if grids else None

    @property
    def audio_feature_lengths(self) -> torch.Tensor | None:
        frames = [m.frames for m in self.media if not m.is_image]
        return torch.tensor(frames, dtype=torch.long) if frames else None

    def model_inputs(self, processor: Any) -> dict[str, torch.Tensor]:
        """Every input transformers' own Thinker takes, all media preprocessed (the parity reference)."""
        inputs = {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids)}
        return {**inputs, **preprocess(self.media, processor)}


def build_prompt(messages: list[Message], processor: Any) -> Prompt:
    """Tokenize a conversation ending in a user turn, with its images and clips in order."""
    pieces = _tokenize_around_replies(messages, processor)
    parts = [p for m in messages for p in m.parts if not isinstance(p, str)]
    tokenizer = processor.tokenizer
    pad_ids = {tokenizer.convert_tokens_to_ids(processor.image_token): "image",
               tokenizer.convert_tokens_to_ids(processor.audio_token): "audio"}
    ids: list[int] = []
    media: list[MediaItem] = []
    for token in pieces:
        kind = pad_ids.get(token)
        if kind is None:
            ids.append(token)
            continue
        if len(media) == len(parts):
            raise RequestError("the conversation's text holds a media placeholder with no image or audio behind it")
        item = _media_item(parts[len(media)], kind, len(ids), processor)
        media.append(item)
        ids += [token] * item.length
    if len(media) != len(parts):
        raise RequestError("the chat template left out an image or audio part of the conversation")
    input_ids = torch.tensor([ids], dtype=torch.long)
    return Prompt(input_ids, media, token_keys(input_ids[0].numpy(), [(m.start, m.length, m.digest) for m in media]))


def _tokenize_around_replies(messages: list[Message], processor: Any) -> list[int]:
    """The rendered template's ids, with each earlier reply's own ids spliced in where it stands."""
    # Each such reply stands in the rendered text as a marker with a random nonce, which no user
    # text can forge; the text is cut at the markers and the reply's ids go between the pieces.
    nonce = secrets.token_hex(8)
    chat, replies = [], []
    for m in messages:
        if m.role == "assistant" and m.token_ids is not None:
            marker = f"<reply {nonce} {len(replies)}>"
            chat.append({"role": m.role, "content": [{"type": "text", "text": marker}]})
            replies.append(m.token_ids)
        else:
            chat.append({"role": m.role, "content": _template_content(m)})
    text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    for i, segment in enumerate(re.split(f"<reply {nonce} (\\d+)>", text)):
        if i % 2:
            ids += replies[int(segment)]
        elif segment:
            ids += processor.tokenizer(segment, add_special_tokens=False)["input_ids"]
    return ids


def _template_content(message: Message) -> list[dict[str, Any]]:
    blocks = []
    for part in message.parts:
        if isinstance(part, str):
            blocks.append({"type": "text", "text": part})
        else:
            blocks.append({"type": "image" if isinstance(part, Image.Image) else "audio"})
    return blocks


def _media_item(part: Part, kind: str, start: int, processor: Any) -> MediaItem:
    if kind == "image":
        if not isinstance(part, Image.Image):
            raise RequestError("the chat template put an image where the conversation has audio")
        grid = image_grid(part, processor.image_processor)
        merge = processor.image_processor.merge_size
        return MediaItem(part, media_digest(part), start, grid[0] * grid[1] * grid[2] // merge**2, grid=grid)
    if not isinstance(part, np.ndarray):
        raise RequestError("the chat template put audio where the conversation has an image")
    if len(part) <= processor.feature_extractor.n_fft // 2:  # the mel window's padding needs more
        raise RequestError(f"an audio clip of {len(part)} samples is too short (under 13 ms)")
    frames = len(part) // processor.feature_extractor.hop_length
    length = int(_get_feat_extract_output_lengths(frames, processor.n_window))
    return MediaItem(part, media_digest(part), start, length, frames=frames)


def image_grid(image: Image.Image, image_processor: Any) -> tuple[int, int, int]:
    """(t, h, w) in patches after the processor's resize, computed from the size alone."""
    patch, merge = image_processor.patch_size, image_processor.merge_size
    size = image_processor.size
    try:
        height, width = smart_resize(
            image.height, image.width, patch * merge, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
    except ValueError as error:  # e.g. an image too thin to cut into patches
        raise RequestError(f"this image cannot be prepared for the model: {error}") from None
    return (1, height // patch, width // patch)


def preprocess(media: list[MediaItem], processor: Any) -> dict[str, torch.Tensor]:
    """Pixels for the images and mel features for the clips among `media`, in order."""
    images = [m.part for m in media if m.is_image]
    clips = [m.part for m in media if not m.is_image]
    return {**(image_inputs(images, processor) if images else {}), **(audio_inputs(clips, processor) if clips else {})}


def image_inputs(images: list[Image.Image], processor: Any) -> dict[str, torch.Tensor]:
    """`pixel_values` [patches, C*T*P*P] and `image_grid_thw` [images, 3], as the processor makes them."""
    encoded = processor.image_processor(images=images, return_tensors="pt")
    return {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}


def audio_inputs(clips: list[np.ndarray], processor: Any) -> dict[str, torch.Tensor]:
    """`input_features` [clips, mel, frames] and `feature_attention_mask` [clips, frames], with the
    processor's own audio settings (padded to the longest clip, never truncated)."""
    encoded = processor.feature_extractor(
        clips, sampling_rate=16_000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
    )
    return {"input_features": encoded["input_features"], "feature_attention_mask": encoded["attention_mask"]}
