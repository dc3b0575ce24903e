"""A conversation, and how it becomes the Thinker's tokens through the checkpoint's own chat template.

Building a prompt does no image resizing and no feature extraction: placeholder counts and M-RoPE
grids follow from each medium's size alone. Pixels and mel features are made later, and only for
the media the prefix cache could not supply (encoder_inputs.py).
"""

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

from omni_local.engine.prompt.template_tokens import TemplateIds
from omni_local.errors import RequestError
from omni_local.media.digests import media_digest
from omni_local.media.video import Video
from omni_local.model.reasoning import ReasoningMarks
from omni_local.protocol.functions import ToolCall
from omni_local.protocol.messages import Message, Part
from omni_local.protocol.text import check_text


@dataclass(frozen=True)
class MediaItem:
    """One image, clip or video of a prompt and the run of placeholder tokens that stands for it (a
    video's frame and sound tokens interleaved by time, one run)."""

    part: Image.Image | np.ndarray | Video
    digest: bytes  # of the decoded content: the cache's key for it
    start: int  # index of its first placeholder token
    length: int  # placeholder tokens
    grid: tuple[int, int, int] | None = None  # images and videos: (t, h, w) in patches
    frames: int | None = None  # audio, and a video's sound track: mel frames
    seconds_per_grid: float | None = None  # videos: seconds per temporal patch
    track_tokens: int = 0  # videos: the sound track's tokens among `length`

    @property
    def is_image(self) -> bool:
        return self.grid is not None and not self.is_video

    @property
    def is_video(self) -> bool:
        return self.seconds_per_grid is not None

    @property
    def has_audio(self) -> bool:
        return self.frames is not None

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
    def video_grid_thw(self) -> torch.Tensor | None:
        grids = [m.grid for m in self.media if m.is_video]
        return torch.tensor(grids, dtype=torch.long) if grids else None

    @property
    def video_second_per_grid(self) -> torch.Tensor | None:
        seconds = [m.seconds_per_grid for m in self.media if m.is_video]
        return torch.tensor(seconds) if seconds else None

    @property
    def audio_feature_lengths(self) -> torch.Tensor | None:
        """Mel frames of every sound, clips and videos' tracks, in prompt order."""
        frames = [m.frames for m in self.media if m.has_audio]
        return torch.tensor(frames, dtype=torch.long) if frames else None

    @property
    def use_audio_in_video(self) -> bool:
        return any(m.is_video and m.has_audio for m in self.media)


def build_prompt(messages: list[Message], processor: Any, reasoning: ReasoningMarks | None = None) -> Prompt:
    """Tokenize a conversation ending in a user turn (or a tool's result), with its images and clips
    in order. `reasoning`: a Thinking checkpoint's markers, by which its earlier replies' reasoning is
    told apart. A system message's tools are offered as the template offers them. A conversation that
    ends in an assistant message has its reply begun with that message's text, in which control tokens
    count as in the template's text: it is a caller's markup (the opening of a call that
    `tool_choice` requires, protocol/tools.py), never a person's text."""
    pieces = _template_ids(messages, processor, reasoning)
    parts = [p for m in messages for p in m.parts if not isinstance(p, str)]
    tokenizer = processor.tokenizer
    pad_ids = {tokenizer.convert_tokens_to_ids(processor.image_token): "image",
               tokenizer.convert_tokens_to_ids(processor.audio_token): "audio",
               tokenizer.convert_tokens_to_ids(processor.video_token): "video"}
    ids: list[int] = []
    media: list[MediaItem] = []
    for token in pieces:
        kind = pad_ids.get(token)
        if kind is None:
            ids.append(token)
            continue
        if len(media) == len(parts):
            raise RequestError("the chat template put a media placeholder where the conversation has no image, "
                               "audio or video")
        before, item, placeholders, after = _media_item(parts[len(media)], kind, len(ids), processor)
        media.append(item)
        ids += before + placeholders + after
    if len(media) != len(parts):
        raise RequestError("the chat template left out an image, audio or video part of the conversation")
    input_ids = torch.tensor([ids], dtype=torch.long)
    return Prompt(input_ids, media, token_keys(input_ids[0].numpy(), [(m.start, m.length, m.digest) for m in media]))


def _template_ids(messages: list[Message], processor: Any, reasoning: ReasoningMarks | None) -> list[int]:
    """The conversation's ids through the chat template: the template's control tokens where it puts
    them and nowhere else, every text part as plain text (a typed `<|im_start|>` is the ids of `<`,
    `|`, ...), and each earlier reply with token ids as those very ids."""
    # Each text part and such reply stands in the rendered text as a marker with a random nonce, which
    # no template holds by chance: what lies between markers is the template's own text.
    nonce = secrets.token_hex(8)
    texts: list[str] = []
    replies: list[list[int]] = []
    begun = messages[-1].text if messages and messages[-1].role == "assistant" else None
    if begun is not None:
        messages = messages[:-1]
    tools = _offered_tools(messages, processor.tokenizer)
    if tools and not messages[0].parts:  # a system message only to offer tools: the template's tools turn alone
        messages = messages[1:]
    chat = [_template_message(m, nonce, texts, replies, processor.tokenizer, reasoning) for m in messages]
    rendered = processor.apply_chat_template(chat, tools=tools or None, tokenize=False, add_generation_prompt=True)
    rendered += begun or ""
    segments = re.split(f"<(text|reply) {nonce} (\\d+)>", rendered)
    ids = TemplateIds(processor.tokenizer)
    ids.template(segments[0])
    for kind, index, template in zip(segments[1::3], segments[2::3], segments[3::3]):
        if kind == "text":
            ids.text(texts[int(index)])
        else:
            ids.exact(replies[int(index)])
        ids.template(template)
    return ids.finish()


def _offered_tools(messages: list[Message], tokenizer: Any) -> list[dict[str, Any]]:
    """The tools the system message offers, as the template lists them. The template writes them as
    JSON into its own text, where control tokens count, so a tool that holds one is refused."""
    if not messages or messages[0].role != "system":
        return []
    tools = [tool.for_template() for tool in messages[0].tools]
    for tool in tools:
        written = json.dumps(tool, ensure_ascii=False)
        token = next((t for t in tokenizer.get_added_vocab() if t in written), None)
        if token is not None:
            raise RequestError(f"tool {tool['function']['name']} holds the model's control token {token}: "
                               "leave it out of its description and parameters")
    return tools


def _template_message(message: Message, nonce: str, texts: list[str], replies: list[list[int]],
                      tokenizer: Any, marks: ReasoningMarks | None) -> dict[str, Any]:
    chat = _message_content(message, nonce, texts, replies, tokenizer, marks)
    if message.tool_calls:
        chat["tool_calls"] = [_call_for_template(call, nonce, texts) for call in message.tool_calls]
    return chat


def _call_for_template(call: ToolCall, nonce: str, texts: list[str]) -> dict[str, Any]:
    """A call with its name and arguments as plain text; the arguments as a string, which the
    template writes as it is."""
    name, arguments = (_text_block(text, nonce, texts)["text"] for text in (call.name, call.arguments))
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _message_content(message: Message, nonce: str, texts: list[str], replies: list[list[int]],
                     tokenizer: Any, marks: ReasoningMarks | None) -> dict[str, Any]:
    """The message for the template, its text and a reply's ids left in `texts` and `replies` with a
    marker in their place. A reply's reasoning goes apart, as `reasoning_content`: the template
    decides whether the next prompt holds it (Qwen's Thinking template keeps it only after the last
    question, so an earlier turn's reasoning is left out)."""
    if message.role == "assistant" and (message.reasoning or message.token_ids is not None):
        return _reply_message(message, nonce, texts, replies, tokenizer, marks)
    blocks = []
    for part in message.parts:
        if isinstance(part, str):
            blocks.append(_text_block(part, nonce, texts))
        else:
            blocks.append({"type": _kind(part)})
    return {"role": message.role, "content": blocks}


def _reply_message(message: Message, nonce: str, texts: list[str], replies: list[list[int]],
                   tokenizer: Any, marks: ReasoningMarks | None) -> dict[str, Any]:
    ids = message.token_ids
    if ids is None:  # a reply known by its text alone (from a remote server)
        answer, reasoning = _text_block(message.text, nonce, texts), message.reasoning
        reasoning_block = _text_block(reasoning, nonce, texts) if reasoning else None
    elif marks is not None and (message.reasoning or marks.end in ids):
        reasoning_ids, answer_ids = marks.split(ids, reasoned=bool(message.reasoning))
        # As the template trims the reasoning's and the answer's blank lines around its markers.
        answer = _reply_block(_trim_blank_lines(answer_ids, tokenizer), nonce, replies)
        reasoning_block = _reply_block(_trim_blank_lines(reasoning_ids, tokenizer), nonce, replies)
    else:
        answer, reasoning_block = _reply_block(ids, nonce, replies), None
    chat: dict[str, Any] = {"role": "assistant", "content": [answer]}
    if reasoning_block is not None:
        chat["reasoning_content"] = reasoning_block["text"]
    return chat


def _text_block(text: str, nonce: str, texts: list[str]) -> dict[str, str]:
    check_text(text, "the conversation")
    texts.append(text)
    return {"type": "text", "text": f"<text {nonce} {len(texts) - 1}>"}


def _reply_block(ids: list[int], nonce: str, replies: list[list[int]]) -> dict[str, str]:
    replies.append(ids)
    return {"type": "text", "text": f"<reply {nonce} {len(replies) - 1}>"}


def _trim_blank_lines(ids: list[int], tokenizer: Any) -> list[int]:
    """`ids` without the tokens at either end that are line breaks only."""
    def blank(token: int) -> bool:
        return tokenizer.decode([token]).strip("\n") == ""

    start, end = 0, len(ids)
    while start < end and blank(ids[start]):
        start += 1
    while end > start and blank(ids[end - 1]):
        end -= 1
    return ids[start:end]


def _kind(part: Part) -> str:
    if isinstance(part, Image.Image):
        return "image"
    if isinstance(part, Video):
        return "video"
    if isinstance(part, np.ndarray):
        return "audio"
    raise RequestError(f"a {type(part).__name__} is not a part of a prompt (a video is read by OmniLocal.read_video)")


def _media_item(part: Part, kind: str, start: int, processor: Any) -> tuple[list[int], MediaItem, list[int], list[int]]:
    """The item for the placeholder at `start`, and the tokens that replace it: markup before, the
    placeholders (the item's run), markup after."""
    if _kind(part) != kind:
        named = {"image": "an image", "audio": "audio", "video": "a video"}
        raise RequestError(f"the chat template put {named[kind]} where the conversation has {named[_kind(part)]}")
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids(getattr(processor, f"{kind}_token"))
    if kind == "image":
        grid = image_grid(part, processor.image_processor)
        merge = processor.image_processor.merge_size
        item = MediaItem(part, media_digest(part), start, grid[0] * grid[1] * grid[2] // merge**2, grid=grid)
        return [], item, [pad] * item.length, []
    if kind == "audio":
        frames = _mel_frames(part, processor)
        length = int(_get_feat_extract_output_lengths(frames, processor.n_window))
        item = MediaItem(part, media_digest(part), start, length, frames=frames)
        return [], item, [pad] * length, []
    return _video_item(part, start, processor)


def _mel_frames(samples: np.ndarray, processor: Any) -> int:
    if len(samples) <= processor.feature_extractor.n_fft // 2:  # the mel window's padding needs more
        raise RequestError(f"an audio clip of {len(samples)} samples is too short (under 13 ms)")
    return len(samples) // processor.feature_extractor.hop_length


def _video_item(video: Video, start: int, processor: Any) -> tuple[list[int], MediaItem, list[int], list[int]]:
    """A video's frame tokens and, with its sound track, the track's tokens interleaved by time
    between <|audio_start|> and <|audio_end|>, as Qwen3-Omni's processor lays them out."""
    tokenizer = processor.tokenizer
    video_pad = tokenizer.convert_tokens_to_ids(processor.video_token)
    grid = video_grid(video, processor.video_processor)
    merge = processor.video_processor.merge_size
    per_frame = grid[1] * grid[2] // merge**2
    seconds_per_grid = processor.video_processor.temporal_patch_size / video.fps
    if video.audio is None:
        item = MediaItem(video, media_digest(video), start, grid[0] * per_frame, grid=grid,
                         seconds_per_grid=seconds_per_grid)
        return [], item, [video_pad] * item.length, []
    audio_pad = tokenizer.convert_tokens_to_ids(processor.audio_token)
    frames = _mel_frames(video.audio, processor)
    sounds = int(_get_feat_extract_output_lengths(frames, processor.n_window))
    # Both kinds are placed by time in position ids (a frame group at its start, a sound token at its
    # index), a frame token first where they tie.
    times = np.concatenate([np.repeat(np.arange(grid[0]) * seconds_per_grid * processor.position_id_per_seconds,
                                      per_frame), np.arange(sounds)])
    is_sound = np.concatenate([np.zeros(grid[0] * per_frame), np.ones(sounds)])
    placeholders = np.where(is_sound[np.lexsort((is_sound, times))] == 1, audio_pad, video_pad).tolist()
    item = MediaItem(video, media_digest(video), start + 1, len(placeholders), grid=grid, frames=frames,
                     seconds_per_grid=seconds_per_grid, track_tokens=sounds)
    opening = tokenizer.convert_tokens_to_ids(processor.audio_bos_token)
    closing = tokenizer.convert_tokens_to_ids(processor.audio_eos_token)
    return [opening], item, placeholders, [closing]


def video_grid(video: Video, video_processor: Any) -> tuple[int, int, int]:
    """(t, h, w) in patches after the video processor's resize, computed from the frames' shape
    alone (its `resize`, with the per-frame pixel cap where the processor applies it)."""
    vp = video_processor
    factor = vp.patch_size * vp.merge_size
    count, height, width = video.frames.shape[:3]
    max_pixels = vp.size.longest_edge
    if getattr(vp, "cap_pixels_per_frame", False):
        total = int(vp.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * vp.temporal_patch_size // count), int(vp.size.shortest_edge * 1.05))
    try:
        height, width = smart_resize(height, width, factor, min_pixels=vp.size.shortest_edge, max_pixels=max_pixels)
    except ValueError as error:
        raise RequestError(f"this video cannot be prepared for the model: {error}") from None
    return (count // vp.temporal_patch_size, height // vp.patch_size, width // vp.patch_size)


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


def token_keys(ids: np.ndarray, media: list[tuple[int, int, bytes]]) -> np.ndarray:
    """One int64 per token: a text token's id, or for the i-th token of a medium a negative number
    from its digest and i. Comparing keys finds a common prefix fast; the media's full digests are
    then compared too (see PrefixCache), so a 63-bit clash cannot pass as a hit."""
    keys = ids.astype(np.int64).copy()
    for start, length, digest in media:
        base = int.from_bytes(digest[:7], "little") << 4
        keys[start : start + length] = -1 - (base + np.arange(length, dtype=np.int64))
    return keys
