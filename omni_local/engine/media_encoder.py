"""Encoder outputs for a prompt's media: from the encoder cache where known, else preprocessed and
encoded (all misses in one batch per kind), then remembered.

An image's output is its merged tokens ("embeds", [tokens, hidden]), one tensor per DeepStack level
("deepstack.0", ...) and its patch grid ("grid", [3]); a clip's is its tokens ("embeds"). Only misses
are preprocessed: a hit resizes nothing, extracts no features and moves no pixels to the device. A
hit is checked against what the prompt expects (the grid, the token count) before it is used.
"""

from typing import Any

import torch

from omni_local.cache.encoder_cache import EncoderCache, EncoderOutput
from omni_local.engine.encoders import Encoders
from omni_local.prompts import MediaItem, preprocess


class MediaEncoder:
    def __init__(self, encoders: Encoders, processor: Any, cache: EncoderCache | None) -> None:
        self.encoders = encoders
        self.processor = processor
        self.cache = cache
        self.device = encoders.visual.device
        self.dtype = encoders.audio_tower.dtype

    def encode(self, media: list[MediaItem], remember: bool = True) -> list[EncoderOutput]:
        """One output per item, in order; `remember=False` neither reads nor fills the cache."""
        cache = self.cache if remember else None
        outputs: list[EncoderOutput | None] = [_fitting(cache.get(m.digest), m) if cache else None for m in media]
        missing = [i for i, output in enumerate(outputs) if output is None]
        if missing:
            fresh = self._encode([media[i] for i in missing])
            for i, output in zip(missing, fresh):
                outputs[i] = output
                if cache is not None:
                    cache.put(media[i].digest, output)
        return outputs

    def _encode(self, media: list[MediaItem]) -> list[EncoderOutput]:
        inputs = preprocess(media, self.processor)
        images = iter(self._images(inputs, [m.length for m in media if m.is_image]) if "pixel_values" in inputs
                      else [])
        clips = iter(self._clips(inputs, [m.length for m in media if not m.is_image]) if "input_features" in inputs
                     else [])
        return [next(images) if m.is_image else next(clips) for m in media]

    def _images(self, inputs: dict[str, torch.Tensor], lengths: list[int]) -> list[EncoderOutput]:
        grids = inputs["image_grid_thw"]
        merged, deepstack = self.encoders.images(inputs["pixel_values"].to(self.device), grids.to(self.device))
        per_image = zip(grids, torch.split(merged, lengths), *(torch.split(level, lengths) for level in deepstack))
        return [{"embeds": tokens, "grid": grid, **{f"deepstack.{i}": level for i, level in enumerate(levels)}}
                for grid, tokens, *levels in per_image]

    def _clips(self, inputs: dict[str, torch.Tensor], lengths: list[int]) -> list[EncoderOutput]:
        features = inputs["input_features"].to(self.device, self.dtype)
        tokens = self.encoders.audio(features, inputs["feature_attention_mask"].to(self.device))
        return [{"embeds": clip} for clip in torch.split(tokens, lengths)]


def _fitting(output: EncoderOutput | None, item: MediaItem) -> EncoderOutput | None:
    """`output` if it has the shape the prompt expects of `item`, else None (then it is encoded again)."""
    if output is None or output["embeds"].shape[0] != item.length:
        return None
    if item.is_image and ("grid" not in output or tuple(output["grid"].tolist()) != item.grid):
        return None
    return output


def deepstack_levels(outputs: list[EncoderOutput]) -> list[torch.Tensor]:
    """The images' DeepStack features, concatenated per level in image order."""
    levels = sorted((k for k in outputs[0] if k.startswith("deepstack.")), key=lambda k: int(k.split(".")[1]))
    return [torch.cat([output[level] for output in outputs]) for level in levels]
