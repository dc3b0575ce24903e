"""Encoder outputs for a prompt's media: from the encoder cache where known, else preprocessed and
encoded (all misses in one batch per kind), then remembered.

An image's output is its merged tokens ("embeds", [tokens, hidden]) and one tensor per DeepStack
level ("deepstack.0", ...); a clip's is its tokens ("embeds"). Only misses are preprocessed: a hit
resizes nothing, extracts no features and moves no pixels to the device.
"""

from typing import Any

import torch

from omni_local.cache.encoder_cache import EncoderCache, EncoderOutput
from omni_local.prompts import MediaItem, preprocess


class MediaEncoder:
    def __init__(self, thinker_model: torch.nn.Module, processor: Any, cache: EncoderCache | None) -> None:
        self.model = thinker_model  # Qwen3OmniMoeThinkerModel: .visual, .audio_tower
        self.processor = processor
        self.cache = cache
        self.device = next(thinker_model.parameters()).device

    def encode(self, media: list[MediaItem]) -> list[EncoderOutput]:
        """One output per item, in order."""
        outputs: list[EncoderOutput | None] = [self.cache.get(m.digest) if self.cache else None for m in media]
        missing = [i for i, output in enumerate(outputs) if output is None]
        if missing:
            fresh = self._encode([media[i] for i in missing])
            for i, output in zip(missing, fresh):
                outputs[i] = output
                if self.cache is not None:
                    self.cache.put(media[i].digest, output)
        return outputs

    def _encode(self, media: list[MediaItem]) -> list[EncoderOutput]:
        inputs = preprocess(media, self.processor)
        images = iter(self._images(inputs) if "pixel_values" in inputs else [])
        clips = iter(self._clips(inputs, [m.length for m in media if not m.is_image]) if "input_features" in inputs
                     else [])
        return [next(images) if m.is_image else next(clips) for m in media]

    def _images(self, inputs: dict[str, torch.Tensor]) -> list[EncoderOutput]:
        pixels = inputs["pixel_values"].to(self.device)
        vision = self.model.get_image_features(pixels, inputs["image_grid_thw"].to(self.device))
        per_image = zip(vision.pooler_output, *vision.deepstack_features)
        return [{"embeds": merged, **{f"deepstack.{i}": level for i, level in enumerate(levels)}}
                for merged, *levels in per_image]

    def _clips(self, inputs: dict[str, torch.Tensor], lengths: list[int]) -> list[EncoderOutput]:
        features = inputs["input_features"].to(self.device, self.model.audio_tower.dtype)
        mask = inputs["feature_attention_mask"].to(self.device)
        tokens = self.model.get_audio_features(features, mask).last_hidden_state
        return [{"embeds": clip} for clip in torch.split(tokens, lengths)]


def deepstack_levels(outputs: list[EncoderOutput]) -> list[torch.Tensor]:
    """The images' DeepStack features, concatenated per level in image order."""
    levels = sorted((k for k in outputs[0] if k.startswith("deepstack.")), key=lambda k: int(k.split(".")[1]))
    return [torch.cat([output[level] for output in outputs]) for level in levels]
