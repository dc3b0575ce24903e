"""Encoder outputs for a prompt's media: from the encoder cache where known, else preprocessed and
encoded (all misses in one batch per kind), then remembered.

An image's output is its merged tokens ("embeds", [tokens, hidden]), one tensor per DeepStack level
("deepstack.0", ...) and its patch grid ("grid", [3]); a clip's is its tokens ("embeds"); a video's
is an image's for all its frames plus its sound track's tokens ("audio"). Only misses
are preprocessed: a hit resizes nothing, extracts no features and moves no pixels to the device. A
miss's frames go to the encoders' device as uint8 and are resized and normalised there (`preprocess`).
A hit is checked against what the prompt expects (the grid, the token count) before it is used.
Outputs are kept per principal (access.py): a hit would tell one person that another sent the same
image (as `MediaCounts.from_cache`, or a faster first token).
"""

from typing import Any

import blake3
import torch

from omni_local.access import principal_salt
from omni_local.engine.forward.encoders import Encoders
from omni_local.engine.memory.encoder_cache import EncoderCache, EncoderOutput
from omni_local.engine.prompt.builder import MediaItem
from omni_local.engine.prompt.encoder_inputs import preprocess


class MediaEncoder:
    def __init__(self, encoders: Encoders, processor: Any, cache: EncoderCache | None) -> None:
        self.encoders = encoders
        self.processor = processor
        self.cache = cache
        self.device = encoders.visual.device
        self.dtype = encoders.audio_tower.dtype

    def encode(self, media: list[MediaItem], principal: str, remember: bool = True
               ) -> tuple[list[EncoderOutput], int]:
        """One output per item, in order, and how many of them ran the encoders (the rest came from
        `principal`'s part of the cache); `remember=False` neither reads nor fills the cache."""
        cache = self.cache if remember else None
        keys = [cache_key(m, principal) for m in media]
        outputs: list[EncoderOutput | None] = [_fitting(cache.get(key), m) if cache else None
                                               for key, m in zip(keys, media)]
        missing = [i for i, output in enumerate(outputs) if output is None]
        if missing:
            fresh = self._encode([media[i] for i in missing])
            for i, output in zip(missing, fresh):
                outputs[i] = output
                if cache is not None:
                    cache.put(keys[i], output)
        return outputs, len(missing)

    def forget(self, media: list[MediaItem], principal: str) -> None:
        """Drop `principal`'s cached outputs for `media`: a request that read them gave logits that are
        not numbers, so they are not to be trusted (each is encoded again when next needed)."""
        if self.cache is not None:
            for item in media:
                self.cache.discard(cache_key(item, principal))

    def _encode(self, media: list[MediaItem]) -> list[EncoderOutput]:
        inputs = preprocess(media, self.processor, self.device)
        images = iter(self._frames(inputs["pixel_values"], inputs["image_grid_thw"], [m for m in media if m.is_image])
                      if "pixel_values" in inputs else [])
        videos = iter(self._frames(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                   [m for m in media if m.is_video]) if "pixel_values_videos" in inputs else [])
        sounds = iter(self._sounds(inputs, [sound_tokens(m) for m in media if m.has_audio])
                      if "input_features" in inputs else [])
        outputs = []
        for m in media:
            if m.is_image:
                outputs.append(next(images))
            elif m.is_video:
                outputs.append({**next(videos), **({"audio": next(sounds)} if m.has_audio else {})})
            else:
                outputs.append({"embeds": next(sounds)})
        return outputs

    def _frames(self, pixels: torch.Tensor, grids: torch.Tensor, media: list[MediaItem]) -> list[EncoderOutput]:
        """Images' or videos' merged tokens and DeepStack levels (the same vision encoder, which
        attends within each frame)."""
        lengths = [visual_tokens(m) for m in media]
        merged, deepstack = self.encoders.images(pixels.to(self.device), grids.to(self.device))
        per_item = zip(grids, torch.split(merged, lengths), *(torch.split(level, lengths) for level in deepstack))
        return [{"embeds": tokens, "grid": grid, **{f"deepstack.{i}": level for i, level in enumerate(levels)}}
                for grid, tokens, *levels in per_item]

    def _sounds(self, inputs: dict[str, torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        features = inputs["input_features"].to(self.device, self.dtype)
        tokens = self.encoders.audio(features, inputs["feature_attention_mask"].to(self.device))
        return list(torch.split(tokens, lengths))


def visual_tokens(item: MediaItem) -> int:
    """Frame tokens of an image or video (a video's run also holds its sound track's)."""
    return item.length - item.track_tokens


def sound_tokens(item: MediaItem) -> int:
    return item.track_tokens if item.is_video else item.length


def cache_key(item: MediaItem, principal: str) -> bytes:
    """The encoder cache's key of `item`'s output for `principal`: its digest, salted."""
    return blake3.blake3(principal_salt(principal) + item.digest).digest()


def _fitting(output: EncoderOutput | None, item: MediaItem) -> EncoderOutput | None:
    """`output` if it has the shape the prompt expects of `item`, else None (then it is encoded again)."""
    if output is None:
        return None
    if item.is_image or item.is_video:
        grid = tuple(output["grid"].tolist()) if "grid" in output else None
        if output["embeds"].shape[0] != visual_tokens(item) or grid != item.grid:
            return None
    elif output["embeds"].shape[0] != item.length:
        return None
    if item.is_video and item.has_audio and ("audio" not in output or output["audio"].shape[0] != sound_tokens(item)):
        return None
    return output


def deepstack_levels(outputs: list[EncoderOutput]) -> list[torch.Tensor]:
    """The images' and videos' DeepStack features, concatenated per level in prompt order."""
    levels = sorted((k for k in outputs[0] if k.startswith("deepstack.")), key=lambda k: int(k.split(".")[1]))
    return [torch.cat([output[level] for output in outputs]) for level in levels]
