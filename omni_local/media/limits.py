"""How large an upload may be, and how amounts are shown against those limits."""

import math
from dataclasses import dataclass

from omni_local.settings import LimitSettings


@dataclass(frozen=True)
class MediaLimits:
    max_upload_bytes: int
    max_image_pixels: int
    max_audio_seconds: float
    max_video_seconds: float = 120.0

    @classmethod
    def from_settings(cls, settings: LimitSettings) -> "MediaLimits":
        return cls(
            max_upload_bytes=settings.max_upload_bytes,
            max_image_pixels=settings.max_image_pixels,
            max_audio_seconds=settings.max_audio_seconds,
            max_video_seconds=settings.max_video_seconds,
        )


def tenths(value: float, *, up: bool) -> str:
    """A measured amount rounded up to tenths ("412.0"), or a limit rounded down ("300", "1,234.5").

    Rounding apart means an amount just over its limit never reads as equal to it
    ("300.1 s is over the limit of 300 s", not "300.0 s ... 300 s").
    """
    scaled = round(value * 10, 6)  # so 412.0 is not pushed to 412.1 by float noise
    if up:
        return f"{math.ceil(scaled) / 10:,.1f}"
    return f"{math.floor(scaled) / 10:,.1f}".removesuffix(".0")
