import io
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from samples import video_file
from omni_local.errors import MediaError, SettingsError
from omni_local.media import MediaLimits, load_image, prepare_image
from omni_local.media.video import load_video
from omni_local.settings import Settings

LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=4096 * 4096, max_audio_seconds=300.0)
TEAL = (0, 128, 128)


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def write(image: Image.Image, path: Path, **options) -> Path:
    image.save(path, **options)
    return path


def png_with_declared_size(path: Path, width: int, height: int) -> Path:
    """A tiny PNG whose header claims `width`×`height` pixels, with an empty pixel stream."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    return path


def paletted(colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, *colour])
    return image


def close_to(pixel: tuple[int, ...], expected: tuple[int, ...], tolerance: int = 6) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


def test_limits_are_read_from_the_settings():
    settings = Settings(max_upload_bytes=1000, max_image_pixels=2000, max_audio_seconds=3.5)
    assert MediaLimits.from_settings(settings) == MediaLimits(1000, 2000, 3.5)


def test_a_limit_of_zero_is_refused_as_a_settings_error():
    with pytest.raises(SettingsError, match=exactly("setting 'max_audio_seconds' must be positive, got 0.0")):
        Settings(max_audio_seconds=0.0)


@pytest.mark.parametrize("extension", ["png", "jpg", "webp", "bmp", "gif"])
def test_each_accepted_format_loads_as_a_detached_rgb_image(tmp_path, extension):
    path = write(Image.new("RGB", (32, 24), TEAL), tmp_path / f"teal.{extension}")

    image = load_image(path, LIMITS)

    assert image.mode == "RGB" and image.size == (32, 24)
    assert not isinstance(image, ImageFile.ImageFile)  # decoded and detached, not a lazy file view
    assert close_to(image.getpixel((16, 12)), TEAL)


def test_a_phone_cameras_multi_picture_jpeg_gives_its_main_picture(tmp_path):
    path = tmp_path / "phone.jpg"
    main, preview = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    main.save(path, format="MPO", save_all=True, append_images=[preview])

    assert close_to(load_image(path, LIMITS).getpixel((4, 4)), (255, 0, 0))


def test_an_image_given_as_bytes_loads_like_a_file():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), TEAL).save(buffer, format="PNG")

    assert load_image(buffer.getvalue(), LIMITS, name="photo.png").getpixel((0, 0)) == TEAL


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (Image.new("L", (4, 4), 100), (100, 100, 100)),
        (Image.new("1", (4, 4), 1), (255, 255, 255)),
        (paletted(TEAL), TEAL),
        (Image.new("RGBA", (4, 4), (*TEAL, 255)), TEAL),
        (Image.new("LA", (4, 4), (100, 255)), (100, 100, 100)),
    ],
    ids=["L", "1", "P", "RGBA-opaque", "LA-opaque"],
)
def test_each_png_mode_is_converted_to_rgb_keeping_its_colours(tmp_path, image, expected):
    converted = load_image(write(image, tmp_path / "mode.png"), LIMITS)

    assert converted.mode == "RGB"
    assert converted.getpixel((0, 0)) == expected


def test_a_16_bit_greyscale_image_keeps_its_brightness_instead_of_turning_white(tmp_path):
    grey = Image.fromarray(np.full((4, 4), 40_000, dtype=np.uint16))  # mode I;16
    assert grey.mode == "I;16"

    converted = load_image(write(grey, tmp_path / "deep.png"), LIMITS)

    assert converted.getpixel((0, 0)) == (156, 156, 156)  # 40000 / 257


def test_a_cmyk_jpeg_is_converted_to_rgb(tmp_path):
    cmyk = Image.new("RGB", (16, 16), TEAL).convert("CMYK")

    converted = load_image(write(cmyk, tmp_path / "print.jpg", quality=95), LIMITS)

    assert converted.mode == "RGB" and close_to(converted.getpixel((8, 8)), TEAL)


@pytest.mark.parametrize(
    "image",
    [
        Image.new("RGBA", (4, 4), (0, 0, 0, 0)),
        Image.new("LA", (4, 4), (0, 0)),
        Image.new("P", (4, 4), 0),  # saved with index 0 as transparent, below
    ],
    ids=["RGBA", "LA", "P-with-transparency"],
)
def test_transparent_pixels_come_out_white(tmp_path, image):
    options = {"transparency": 0} if image.mode == "P" else {}

    converted = load_image(write(image, tmp_path / "clear.png", **options), LIMITS)

    assert converted.getpixel((0, 0)) == (255, 255, 255)


def test_half_transparent_pixels_are_blended_with_white(tmp_path):
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 128))

    converted = load_image(write(image, tmp_path / "shade.png"), LIMITS)

    assert close_to(converted.getpixel((0, 0)), (127, 127, 127), tolerance=1)


def test_a_jpeg_with_exif_orientation_6_is_turned_upright(tmp_path):
    stored = Image.new("RGB", (40, 20), (255, 0, 0))
    stored.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    path = write(stored, tmp_path / "phone.jpg", exif=exif, quality=95)

    upright = load_image(path, LIMITS)

    assert upright.size == (20, 40)
    assert close_to(upright.getpixel((10, 5)), (255, 0, 0), tolerance=20)  # the left half is now on top
    assert close_to(upright.getpixel((10, 35)), (0, 0, 255), tolerance=20)


def test_an_animated_gif_gives_its_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), colour) for colour in [(255, 0, 0), (0, 0, 255)]]
    path = tmp_path / "blink.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)

    assert load_image(path, LIMITS).getpixel((4, 4)) == (255, 0, 0)


def test_a_truncated_png_is_reported_as_corrupt(tmp_path):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    whole = write(noise, tmp_path / "whole.png").read_bytes()
    (tmp_path / "photo.png").write_bytes(whole[: len(whole) // 2])

    with pytest.raises(MediaError, match=exactly("photo.png: the file is truncated or corrupt (not a readable image)")):
        load_image(tmp_path / "photo.png", LIMITS)


def test_a_tiff_is_refused_with_the_list_of_accepted_formats(tmp_path):
    path = write(Image.new("RGB", (8, 8)), tmp_path / "scan.tiff")

    message = "scan.tiff: not a supported image (PNG, JPEG, WebP, BMP or GIF expected)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_image(path, LIMITS)


def test_a_text_file_named_png_is_refused_as_not_an_image(tmp_path):
    (tmp_path / "notes.png").write_text("just some words\n" * 20)

    with pytest.raises(MediaError, match=r"^notes\.png: not a supported image"):
        load_image(tmp_path / "notes.png", LIMITS)


def test_an_empty_file_is_reported_as_empty(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")

    with pytest.raises(MediaError, match=exactly("empty.png: the file is empty")):
        load_image(tmp_path / "empty.png", LIMITS)


def test_a_missing_file_is_reported_as_not_found(tmp_path):
    with pytest.raises(MediaError, match=exactly("nowhere.png: file not found")):
        load_image(tmp_path / "nowhere.png", LIMITS)


def test_a_folder_is_not_taken_for_an_image(tmp_path):
    (tmp_path / "album.png").mkdir()

    with pytest.raises(MediaError, match=exactly("album.png: is a folder, not a file")):
        load_image(tmp_path / "album.png", LIMITS)


def test_an_upload_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "x.png"
    with path.open("wb") as file:
        file.truncate(63_124_275)  # 60.2 MB, sparse: nothing is written, and nothing should be read

    message = "x.png: 60.2 MB is over the upload limit of 50 MB (max_upload_bytes)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_image(path, LIMITS)


def test_bytes_over_a_small_size_limit_are_counted_in_bytes():
    small = MediaLimits(max_upload_bytes=1000, max_image_pixels=100, max_audio_seconds=1.0)

    with pytest.raises(MediaError, match=r"^upload: 5,000 bytes is over the upload limit of 1,000 bytes"):
        load_image(b"\0" * 5000, small)


def test_an_image_over_the_pixel_limit_is_refused_with_its_size(tmp_path):
    path = write(Image.new("RGB", (3000, 3000)), tmp_path / "big.png")
    limits = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=1000 * 1000, max_audio_seconds=1.0)

    message = "big.png: 3000×3000 pixels is over the limit of 1,000,000 pixels (max_image_pixels)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_image(path, limits)


def test_a_huge_size_in_the_header_is_refused_before_decoding_and_without_warnings(tmp_path):
    path = png_with_declared_size(tmp_path / "big.png", 10_000, 10_000)  # above Pillow's own warning threshold

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        message = "big.png: 10000×10000 pixels is over the limit of 16,777,216 pixels (max_image_pixels)"
        with pytest.raises(MediaError, match=exactly(message)):
            load_image(path, LIMITS)


def test_a_decompression_bomb_beyond_pillows_own_limit_reads_as_over_our_limit(tmp_path):
    path = png_with_declared_size(tmp_path / "bomb.png", 100_000, 100_000)

    message = "bomb.png: the image is over the limit of 16,777,216 pixels (max_image_pixels)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_image(path, LIMITS)


def test_a_decompression_bomb_under_a_generous_limit_names_pillows_limit(tmp_path):
    path = png_with_declared_size(tmp_path / "bomb.png", 100_000, 100_000)
    generous = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=10**12, max_audio_seconds=1.0)

    with pytest.raises(MediaError, match=r"^bomb\.png: the image is over Pillow's safety limit of [\d,]+ pixels$"):
        load_image(path, generous)


def test_an_image_too_narrow_for_the_model_is_refused_naming_the_file(tmp_path):
    path = write(Image.new("RGB", (1000, 4), TEAL), tmp_path / "banner.png")

    message = "banner.png: the image is 1000×4 pixels, too narrow for the model (one side at most 200 times the other)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_image(path, LIMITS)


def test_an_image_whose_sides_are_exactly_200_to_1_is_accepted(tmp_path):
    path = write(Image.new("RGB", (4, 800), TEAL), tmp_path / "ribbon.png")

    assert load_image(path, LIMITS).size == (4, 800)


def test_an_image_in_memory_too_narrow_for_the_model_is_refused_as_image():
    with pytest.raises(MediaError, match=r"^image: the image is 2×401 pixels, too narrow for the model"):
        prepare_image(Image.new("RGB", (2, 401)), LIMITS)


def test_a_video_whose_frames_are_too_narrow_for_the_model_is_refused_naming_the_file():
    data = video_file(3, size=(1000, 4), sound=False)

    message = "strip.mp4: each frame is 1000×4 pixels, too narrow for the model (one side at most 200 times the other)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_video(data, LIMITS, fps=2.0, name="strip.mp4")
