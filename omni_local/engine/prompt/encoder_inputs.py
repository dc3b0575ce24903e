"""The encoders' inputs for a prompt's media: pixels for images and videos, mel features for sounds,
as the checkpoint's processors make them. The engine makes them only for the media the encoder
cache misses (media_encoder.py); the whole prompt's, for transformers' own Thinker, are the parity
reference the tests and benchmarks compare with.
"""

from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_local.engine.prompt.builder import MediaItem, Prompt
from omni_local.media.video import Video


def transformers_inputs(prompt: Prompt, processor: Any, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Every input transformers' own Thinker takes, all media preprocessed (the parity reference);
    `device` as for `preprocess` (give the engine's, so both are given the same pixels)."""
    inputs = {"input_ids": prompt.input_ids, "attention_mask": torch.ones_like(prompt.input_ids)}
    if prompt.video_grid_thw is not None:
        inputs |= {"video_second_per_grid": prompt.video_second_per_grid,
                   "use_audio_in_video": prompt.use_audio_in_video}
    return {**inputs, **preprocess(prompt.media, processor, device)}


def preprocess(media: list[MediaItem], processor: Any, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Pixels for the images and videos and mel features for the sounds (clips and videos' tracks)
    among `media`, each kind in order.

    `device`: where the image and video processors resize, rescale, normalise and patchify: the
    decoded pixels go there once, as uint8, and `pixel_values` / `pixel_values_videos` come back on
    it (grids stay on the CPU; None, or a processor without torchvision: all on the CPU). On the CPU
    the result is bit for bit the plain call's. On CUDA torchvision resizes uint8 in float32 and
    rounds, where the CPU has a uint8 kernel that rounds and clamps between its two passes: about a
    fifth of the pixels of a photo-like image differ by one level (0.015 after normalising), a noise
    image's by more. So compare the model with transformers given the same device's pixels. Mel
    features are made on the CPU (the feature extractor's output is numpy).
    """
    images = [m.part for m in media if m.is_image]
    videos = [m.part for m in media if m.is_video]
    sounds = [m.part.audio if m.is_video else m.part for m in media if m.has_audio]
    return {
        **(image_inputs(images, processor, device) if images else {}),
        **(video_inputs(videos, processor, device) if videos else {}),
        **(audio_inputs(sounds, processor) if sounds else {}),
    }


def video_inputs(videos: list[Video], processor: Any, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """`pixel_values_videos` and `video_grid_thw` as the video processor makes them from the frames
    (on `device`, as in `preprocess`)."""
    encoded = processor.video_processor(videos=[v.frames for v in videos], do_sample_frames=False, device=device,
                                        return_tensors="pt")
    return {"pixel_values_videos": encoded["pixel_values_videos"], "video_grid_thw": encoded["video_grid_thw"]}


def image_inputs(images: list[Image.Image], processor: Any,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """`pixel_values` [patches, C*T*P*P] and `image_grid_thw` [images, 3], as the processor makes them
    (on `device`, as in `preprocess`)."""
    encoded = processor.image_processor(images=images, device=device, return_tensors="pt")
    return {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}


def audio_inputs(clips: list[np.ndarray], processor: Any) -> dict[str, torch.Tensor]:
    """`input_features` [clips, mel, frames] and `feature_attention_mask` [clips, frames], with the
    processor's own audio settings (padded to the longest clip, never truncated)."""
    encoded = processor.feature_extractor(
        clips, sampling_rate=16_000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
    )
    return {"input_features": encoded["input_features"], "feature_attention_mask": encoded["attention_mask"]}
