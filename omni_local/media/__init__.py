"""Decoding user uploads (images and audio) within the limits of the settings, with clear errors."""

from omni_local.media.audio import SAMPLE_RATE, check_duration, load_audio
from omni_local.media.image import load_image, prepare_image
from omni_local.media.limits import MediaLimits

__all__ = ["SAMPLE_RATE", "check_duration", "MediaLimits", "load_audio", "load_image", "prepare_image"]
