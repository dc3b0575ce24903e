"""A medium's digest follows what the model sees of it, not the file it came in."""

from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from omni_local.media import MediaLimits, load_audio, load_image
from omni_local.media.digests import media_digest

LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=4096 * 4096, max_audio_seconds=300.0)


def noise_picture(width: int = 48, height: int = 32, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def noise_clip(samples: int = 16_000, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


def saved(image: Image.Image, path: Path, **options) -> Path:
    image.save(path, **options)
    return path


# Images -------------------------------------------------------------------------------------------


def test_the_same_picture_as_png_lossless_webp_or_another_name_has_one_digest(tmp_path):
    image = noise_picture()
    files = [
        saved(image, tmp_path / "photo.png"),
        saved(image, tmp_path / "photo.webp", lossless=True),
        saved(image, tmp_path / "renamed copy.png"),
    ]
    digests = {media_digest(load_image(f, LIMITS)) for f in files}
    assert digests == {media_digest(image)}


def test_a_paletted_png_has_the_digest_of_the_same_colours_in_rgb(tmp_path):
    paletted = Image.new("P", (8, 8), 0)
    paletted.putpalette([10, 20, 30, 200, 100, 50])
    paletted.paste(1, (2, 2, 6, 6))
    rgb = paletted.convert("RGB")
    assert media_digest(load_image(saved(paletted, tmp_path / "p.png"), LIMITS)) == media_digest(
        load_image(saved(rgb, tmp_path / "rgb.png"), LIMITS)
    )


def test_a_transparent_png_has_the_digest_of_the_same_picture_already_composited_on_white(tmp_path):
    # load_image shows transparency on white; the model sees that, so the cache keys that.
    rgba = noise_picture().convert("RGBA")
    alpha = np.full((rgba.height, rgba.width), 255, dtype=np.uint8)
    alpha[:, : rgba.width // 2] = 0
    alpha[0, -1] = 128
    rgba.putalpha(Image.fromarray(alpha))
    composited = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    from_rgba = load_image(saved(rgba, tmp_path / "logo.png"), LIMITS)
    from_rgb = load_image(saved(composited, tmp_path / "flat.png"), LIMITS)
    assert media_digest(from_rgba) == media_digest(from_rgb)
    assert media_digest(from_rgba) != media_digest(rgba.convert("RGB"))  # not the dropped-alpha colours


def test_one_changed_pixel_gives_another_digest():
    image = noise_picture()
    changed = image.copy()
    red, green, blue = changed.getpixel((17, 9))
    changed.putpixel((17, 9), (red, green, blue ^ 1))
    assert media_digest(changed) != media_digest(image)


def test_the_same_bytes_in_another_shape_give_another_digest():
    image = noise_picture(4, 3)
    transposed = Image.frombytes("RGB", (3, 4), image.tobytes())
    assert media_digest(transposed) != media_digest(image)


def test_an_image_and_a_clip_of_the_same_bytes_have_different_digests():
    image = noise_picture(4, 1)  # 12 bytes, as are 3 float32 samples
    samples = np.frombuffer(image.tobytes(), dtype=np.float32)
    assert media_digest(image) != media_digest(samples)


def test_only_rgb_images_are_keyed():
    with pytest.raises(AssertionError):
        media_digest(noise_picture().convert("RGBA"))


# Audio --------------------------------------------------------------------------------------------


def test_the_same_samples_give_the_same_audio_digest():
    samples = noise_clip()
    assert media_digest(samples) == media_digest(samples.copy())
    assert media_digest(samples) == media_digest(samples.astype(np.float64))  # keyed as the float32 it becomes


def test_a_strided_view_has_the_digest_of_its_contiguous_copy():
    every_other = noise_clip(32_000)[::2]
    assert not every_other.flags.c_contiguous
    assert media_digest(every_other) == media_digest(np.ascontiguousarray(every_other))


def test_one_changed_sample_gives_another_audio_digest():
    samples = noise_clip()
    changed = samples.copy()
    changed[12_345] = np.nextafter(changed[12_345], np.float32(1))
    assert media_digest(changed) != media_digest(samples)


def test_a_clip_and_its_prefix_have_different_digests():
    samples = noise_clip()
    assert media_digest(samples[:-1]) != media_digest(samples)


def test_a_clip_read_back_from_a_float_wav_has_the_digest_of_its_samples(tmp_path):
    samples = noise_clip()
    soundfile.write(tmp_path / "voice.wav", samples, 16_000, subtype="FLOAT")
    assert media_digest(load_audio(tmp_path / "voice.wav", LIMITS)) == media_digest(samples)


def test_digests_are_32_bytes():
    assert len(media_digest(noise_clip())) == 32
    assert len(media_digest(noise_picture())) == 32
