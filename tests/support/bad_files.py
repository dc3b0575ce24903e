"""Bad uploads, made on the spot, with the words their error must contain (API, CLI and UI tests),
and the limits the tests hold uploads to."""

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from omni_local.errors import MediaError
from omni_local.media import MediaLimits, load_audio, load_image

# Limits low enough that small files break them (the tests launch the app with these).
MAX_IMAGE_PIXELS = 100_000
MAX_AUDIO_SECONDS = 2.0
LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=MAX_IMAGE_PIXELS, max_audio_seconds=MAX_AUDIO_SECONDS)
BAD_FILES = ["truncated png", "text named wav", "zero-byte file", "image over the pixel limit",
             "clip over the length limit", "wav of NaN samples", "wav cut short after its header",
             "image too narrow for the model"]


def write_bad_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """name (one of BAD_FILES) -> (file, a phrase its error message must hold)."""
    png = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(png, format="PNG")  # noise, so the file is long enough to cut
    files = {
        "truncated png": ("cut.png", png.getvalue()[:200], "cut.png: the file is truncated or corrupt"),
        "text named wav": ("notes.wav", b"just some text, not sound\n" * 20, "notes.wav: not an audio file"),
        "zero-byte file": ("empty.png", b"", "empty.png: the file is empty"),
    }
    made = {}
    for case, (name, data, phrase) in files.items():
        (folder / name).write_bytes(data)
        made[case] = (folder / name, phrase)
    Image.new("RGB", (400, 400), (0, 90, 200)).save(folder / "huge.png")
    made["image over the pixel limit"] = (folder / "huge.png", "huge.png: 400×400 pixels is over the limit")
    soundfile.write(folder / "long.wav", np.zeros(16_000 * 3, dtype=np.float32), 16_000)
    made["clip over the length limit"] = (folder / "long.wav", "long.wav: 3.0 s is over the limit of 2 s")
    soundfile.write(folder / "nan.wav", np.full(16_000, np.nan, dtype=np.float32), 16_000, subtype="FLOAT")
    made["wav of NaN samples"] = (folder / "nan.wav", "nan.wav: the clip holds NaN or infinite samples")
    whole = io.BytesIO()
    soundfile.write(whole, np.zeros(16_000, dtype=np.int16), 16_000, format="WAV")
    (folder / "cut.wav").write_bytes(whole.getvalue()[:100])  # the header and 28 samples
    made["wav cut short after its header"] = (folder / "cut.wav", "cut.wav: the clip is too short for the model")
    Image.new("RGB", (1000, 4), (200, 40, 40)).save(folder / "strip.png")
    made["image too narrow for the model"] = (folder / "strip.png", "strip.png: the image is 1000×4 pixels, too narrow")
    return made


def good_image(folder: Path) -> Path:
    path = folder / "good.png"
    Image.new("RGB", (96, 64), (20, 160, 90)).save(path)
    return path


def media_error(path: Path) -> str:
    """What omni_local.media says about the file under LIMITS, read directly."""
    loader = load_audio if path.suffix == ".wav" else load_image
    with pytest.raises(MediaError) as error:
        loader(path, LIMITS)
    return str(error.value)
