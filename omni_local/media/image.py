"""Decoding an uploaded image into a plain RGB picture, refusing bombs before decoding pixels."""

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from omni_local.errors import MediaError
from omni_local.media.limits import MediaLimits
from omni_local.media.upload import read_upload

# Pillow's names. MPO (a JPEG with extra frames, as many phone cameras write) opens through JPEG.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
_EXPECTED = "PNG, JPEG, WebP, BMP or GIF expected"
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I")
# The vision processor's resize (transformers' `smart_resize`) refuses a picture whose long side is
# more than this many times its short side; refused here instead, where the file's name is known.
MAX_ASPECT_RATIO = 200


def load_image(source: str | Path | bytes, limits: MediaLimits, name: str | None = None) -> Image.Image:
    """A fully loaded RGB image, upright per its EXIF orientation, detached from the file.

    Raises `MediaError` for a missing, empty, oversized, unsupported or corrupt file.
    """
    upload = read_upload(source, limits, name)
    # Pillow warns about large images itself; our own limit below is the one that decides.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = _open(upload.name, upload.data, limits)
        try:
            with image:
                image.load()  # the first frame only, for GIF and animated WebP
                return _to_rgb(ImageOps.exif_transpose(image))
        # Pillow's decoders raise many exception types on bad data; to the user they all mean one thing.
        except Exception:
            raise MediaError(f"{upload.name}: the file is truncated or corrupt (not a readable image)") from None


def prepare_image(image: Image.Image, limits: MediaLimits, name: str = "image") -> Image.Image:
    """An image already in memory (the Python API takes PIL images), held to the same limit and
    turned into RGB the same way as a loaded file."""
    check_size(name, *image.size, limits)
    return _to_rgb(image)


def check_size(name: str, width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"{name}: {width}×{height} pixels is over the limit of {limits.max_image_pixels:,} pixels "
            "(max_image_pixels)"
        )
    check_shape(name, width, height)


def check_shape(name: str, width: int, height: int, what: str = "the image") -> None:
    """Refuse a picture too narrow for the model."""
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise MediaError(f"{name}: {what} is {width}×{height} pixels, too narrow for the model "
                         f"(one side at most {MAX_ASPECT_RATIO} times the other)")


def _open(name: str, data: bytes, limits: MediaLimits) -> Image.Image:
    """The image with its header read and its size checked, before any pixel is decoded."""
    try:
        # Only our formats' parsers ever see the bytes.
        image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError:
        # Pillow's own limit (twice Image.MAX_IMAGE_PIXELS) struck before ours could see the size.
        pillow_limit = 2 * Image.MAX_IMAGE_PIXELS
        if limits.max_image_pixels < pillow_limit:
            raise MediaError(
                f"{name}: the image is over the limit of {limits.max_image_pixels:,} pixels (max_image_pixels)"
            ) from None
        raise MediaError(f"{name}: the image is over Pillow's safety limit of {pillow_limit:,} pixels") from None
    except UnidentifiedImageError:
        raise MediaError(f"{name}: not a supported image ({_EXPECTED})") from None
    except Exception:
        raise MediaError(f"{name}: the file is truncated or corrupt (not a readable image)") from None
    try:
        check_size(name, *image.size, limits)
    except MediaError:
        image.close()
        raise
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in _SIXTEEN_BIT_MODES:
        # Pillow's own conversion clips 16-bit values at 255 (a white picture); scale them instead.
        eight_bit = (np.asarray(image, dtype=np.float32) / 257).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(eight_bit).convert("RGB")
    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        # The model sees RGB only. Dropping alpha would show whatever colour the transparent pixels
        # happen to hold (often black: black text on a transparent logo becomes a black square);
        # white is how most viewers and documents show transparency.
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")  # a new image even when already RGB, so none shares the file's
