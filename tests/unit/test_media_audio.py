import io
import re
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile

from omni_local.errors import MediaError
from omni_local.media import SAMPLE_RATE, MediaLimits, load_audio
from omni_local.media.video import Video, load_video

LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=4096 * 4096, max_audio_seconds=300.0)
VIDEO_LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=4096 * 4096, max_audio_seconds=300.0,
                           max_video_seconds=10.0)


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def sine(rate: int, channels: int, seconds: float = 1.0, hertz: float = 440.0) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * hertz * t)
    return np.repeat(wave[:, None], channels, axis=1)  # (frames, channels)


def write(path: Path, samples: np.ndarray, rate: int, subtype: str | None = None) -> Path:
    soundfile.write(path, samples, rate, subtype=subtype)
    return path


def peak_hertz(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / SAMPLE_RATE)[spectrum.argmax()])


# Opus only runs at 8, 12, 16, 24 or 48 kHz, so it stands in with 48 kHz for 44.1 kHz.
@pytest.mark.parametrize(
    ("file_name", "subtype", "rate", "channels"),
    [
        ("tone.wav", "PCM_16", 44_100, 2),
        ("tone.wav", "PCM_16", 8_000, 1),
        ("tone.wav", "FLOAT", 44_100, 2),
        ("tone.flac", None, 44_100, 2),
        ("tone.flac", None, 8_000, 1),
        ("tone.ogg", "VORBIS", 44_100, 2),
        ("tone.ogg", "VORBIS", 8_000, 1),
        ("tone.ogg", "OPUS", 48_000, 2),
        ("tone.ogg", "OPUS", 8_000, 1),
        ("tone.mp3", "MPEG_LAYER_III", 44_100, 2),
        ("tone.mp3", "MPEG_LAYER_III", 8_000, 1),
    ],
)
def test_each_format_becomes_one_second_of_16khz_mono_float32_at_the_same_pitch(
    tmp_path, file_name, subtype, rate, channels
):
    path = write(tmp_path / file_name, sine(rate, channels), rate, subtype)

    samples = load_audio(path, LIMITS)

    assert samples.dtype == np.float32 and samples.ndim == 1
    # Lossless formats keep the length exactly; lossy codecs may add or trim a little encoder delay.
    tolerance = 0 if file_name.endswith((".wav", ".flac")) else SAMPLE_RATE // 10
    assert abs(len(samples) - SAMPLE_RATE) <= tolerance
    assert abs(peak_hertz(samples) - 440) < 5


def test_audio_given_as_bytes_loads_like_a_file(tmp_path):
    data = write(tmp_path / "tone.wav", sine(SAMPLE_RATE, 1), SAMPLE_RATE).read_bytes()

    assert len(load_audio(data, LIMITS, name="tone.wav")) == SAMPLE_RATE


def test_integer_samples_are_scaled_into_minus_one_to_one(tmp_path):
    extremes = np.tile(np.array([[32767], [-32768], [0]], dtype=np.int16), (100, 1))  # 300 samples: long enough
    path = write(tmp_path / "loud.wav", extremes, SAMPLE_RATE, "PCM_16")

    samples = load_audio(path, LIMITS)

    assert samples.tolist() == pytest.approx([32767 / 32768, -1.0, 0.0] * 100)


def test_channels_are_averaged_into_one(tmp_path):
    left_and_right = np.tile([0.5, 0.25], (300, 1))
    path = write(tmp_path / "stereo.wav", left_and_right, SAMPLE_RATE, "FLOAT")

    assert load_audio(path, LIMITS) == pytest.approx(np.full(300, 0.375))


def test_a_clip_over_the_length_limit_is_refused_from_its_header(tmp_path, monkeypatch):
    path = write(tmp_path / "talk.wav", np.zeros((412 * 1000, 1), dtype=np.int16), 1000, "PCM_16")
    # Reading a single frame would mean the header check came too late.
    monkeypatch.setattr(soundfile.SoundFile, "read", lambda *args, **kwargs: pytest.fail("decoded"))

    with pytest.raises(MediaError, match=exactly("talk.wav: 412.0 s is over the limit of 300 s (max_audio_seconds)")):
        load_audio(path, LIMITS)


def test_a_clip_of_zero_samples_is_refused(tmp_path):
    path = write(tmp_path / "silence.wav", np.zeros((0, 1)), SAMPLE_RATE)

    with pytest.raises(MediaError, match=exactly("silence.wav: the clip has no audio (zero samples)")):
        load_audio(path, LIMITS)


def test_a_clip_too_short_to_last_one_16khz_sample_is_refused(tmp_path):
    path = write(tmp_path / "blip.wav", np.zeros((1, 1)), 48_000)

    with pytest.raises(MediaError, match=r"^blip\.wav: the clip has no audio"):
        load_audio(path, LIMITS)


def test_a_text_file_named_wav_is_refused_as_not_audio(tmp_path):
    (tmp_path / "notes.wav").write_text("shopping list: eggs, milk\n" * 20)

    with pytest.raises(MediaError, match=exactly("notes.wav: not an audio file (WAV, FLAC, OGG or MP3 expected)")):
        load_audio(tmp_path / "notes.wav", LIMITS)


def test_an_aiff_file_is_refused_with_the_list_of_accepted_formats(tmp_path):
    path = write(tmp_path / "tone.aiff", sine(SAMPLE_RATE, 1), SAMPLE_RATE)

    message = "tone.aiff: AIFF audio is not supported (WAV, FLAC, OGG or MP3 expected)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_audio(path, LIMITS)


def test_an_empty_file_is_reported_as_empty(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")

    with pytest.raises(MediaError, match=exactly("empty.wav: the file is empty")):
        load_audio(tmp_path / "empty.wav", LIMITS)


def test_a_missing_file_is_reported_as_not_found(tmp_path):
    with pytest.raises(MediaError, match=exactly("gone.mp3: file not found")):
        load_audio(tmp_path / "gone.mp3", LIMITS)


def test_an_upload_over_the_size_limit_is_refused(tmp_path):
    path = write(tmp_path / "tone.wav", sine(SAMPLE_RATE, 1), SAMPLE_RATE)  # about 31 KB
    limits = MediaLimits(max_upload_bytes=10 << 10, max_image_pixels=100, max_audio_seconds=300.0)

    message = "tone.wav: 31.3 KB is over the upload limit of 10 KB (max_upload_bytes)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_audio(path, limits)


def test_bytes_without_a_name_are_called_upload_in_errors():
    with pytest.raises(MediaError, match=r"^upload: not an audio file"):
        load_audio(b"not sound at all", LIMITS)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["NaN", "infinity", "minus infinity"])
def test_a_float_wav_holding_a_sample_that_is_not_a_number_is_refused_naming_the_file(tmp_path, bad):
    samples = sine(SAMPLE_RATE, 1)
    samples[100] = bad
    path = write(tmp_path / "speech.wav", samples, SAMPLE_RATE, "FLOAT")

    message = "speech.wav: the clip holds NaN or infinite samples (corrupt audio)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_audio(path, LIMITS)


def test_a_double_wav_beyond_float32s_range_is_refused_as_infinite(tmp_path):
    path = write(tmp_path / "speech.wav", np.full((1000, 1), 1e300), SAMPLE_RATE, "DOUBLE")

    with pytest.raises(MediaError, match=r"^speech\.wav: the clip holds NaN or infinite samples"):
        load_audio(path, LIMITS)


def test_a_float_wav_of_16_bit_values_is_refused_as_far_outside_full_scale(tmp_path):
    path = write(tmp_path / "loud.wav", sine(SAMPLE_RATE, 1) * 65_534, SAMPLE_RATE, "FLOAT")  # peaks at 32,767

    message = "loud.wav: the clip's samples reach 32,767, far outside [-1, 1] (corrupt or wrongly scaled audio)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_audio(path, LIMITS)


def test_a_float_wav_peaking_a_little_above_full_scale_is_kept_as_it_is(tmp_path):
    path = write(tmp_path / "hot.wav", sine(SAMPLE_RATE, 1) * 4, SAMPLE_RATE, "FLOAT")  # peaks at 2, +6 dB

    assert float(np.abs(load_audio(path, LIMITS)).max()) == pytest.approx(2.0)


def test_a_resampled_clip_holding_nan_is_refused_too(tmp_path):
    samples = sine(44_100, 2)
    samples[5000, 1] = np.nan
    path = write(tmp_path / "stereo.wav", samples, 44_100, "FLOAT")

    with pytest.raises(MediaError, match=r"^stereo\.wav: the clip holds NaN"):
        load_audio(path, LIMITS)


def test_a_wav_cut_short_after_its_header_is_refused_naming_the_file(tmp_path):
    whole = write(tmp_path / "whole.wav", sine(SAMPLE_RATE, 1), SAMPLE_RATE, "PCM_16").read_bytes()
    (tmp_path / "cut.wav").write_bytes(whole[:100])  # the 44-byte header and 28 samples

    message = "cut.wav: the clip is too short for the model (28 samples, under 13 ms)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_audio(tmp_path / "cut.wav", LIMITS)


def test_the_shortest_clip_the_audio_encoder_takes_is_accepted(tmp_path):
    path = write(tmp_path / "click.wav", np.zeros((201, 1)), SAMPLE_RATE, "PCM_16")

    assert len(load_audio(path, LIMITS)) == 201


def test_a_videos_sound_track_of_nan_samples_is_refused_naming_the_file():
    track = np.zeros(SAMPLE_RATE, np.float32)
    track[:100] = np.nan

    message = "film.mov: the sound track holds NaN or infinite samples (corrupt audio)"
    with pytest.raises(MediaError, match=exactly(message)):
        load_video(video_with_float_track(track), VIDEO_LIMITS, fps=2.0, name="film.mov")


def test_a_videos_clean_float_sound_track_is_read():
    track = sine(SAMPLE_RATE, 1)[:, 0].astype(np.float32)

    video = load_video(video_with_float_track(track), VIDEO_LIMITS, fps=2.0, name="film.mov")

    assert video.audio == pytest.approx(track, abs=1e-6)


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (np.full(SAMPLE_RATE, np.nan, np.float32),
         "audio[0]: the clip holds NaN or infinite samples (corrupt audio)"),
        ((sine(SAMPLE_RATE, 1)[:, 0] * 65_534).astype(np.int16),
         "audio[0]: the clip's samples reach 32,767, far outside [-1, 1] (corrupt or wrongly scaled audio)"),
        (np.zeros(100, np.float32), "audio[0]: the clip is too short for the model (100 samples, under 13 ms)"),
    ],
    ids=["NaN", "16-bit values", "too short"],
)
def test_samples_given_to_the_api_are_held_to_the_same_checks_as_a_file(app, samples, message):
    session = app.session()

    with pytest.raises(MediaError, match=exactly(message)):
        session.send("What do you hear?", audio=[samples])
    assert session.history == []


@pytest.mark.parametrize("layout", ["(samples, channels)", "(channels, samples)"])
def test_a_two_channel_array_given_to_the_api_is_mixed_down_to_one_channel(app, layout):
    rng = np.random.default_rng(3)
    left, right = (rng.uniform(-0.5, 0.5, SAMPLE_RATE).astype(np.float32) for _ in range(2))
    stereo = np.stack([left, right], axis=1 if layout == "(samples, channels)" else 0)
    session = app.session()
    session.send("What do you hear?", audio=[stereo], max_new_tokens=1).result()
    (mono,) = session.history[0].audios()
    np.testing.assert_array_equal(mono, (left + right) / 2)  # one second, not two


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((SAMPLE_RATE, 16), "audio[0]: an array of shape (16000, 16) is not (samples, channels) or (channels, "
                            "samples) with at most 8 channels"),
        ((6, 8), "audio[0]: an array of shape (6, 8) is not (samples, channels) or (channels, samples) with at "
                 "most 8 channels"),
        ((2, SAMPLE_RATE, 1), "audio[0]: an array of 3 dimensions is not samples (one dimension, or two with "
                              "channels)"),
    ],
    ids=["16 channels", "which axis", "3 dimensions"],
)
def test_an_array_whose_channels_cannot_be_told_is_refused_saying_which_layouts_are_taken(app, shape, message):
    session = app.session()
    with pytest.raises(MediaError, match=exactly(message)):
        session.send("What do you hear?", audio=[np.zeros(shape, np.float32)])
    assert session.history == []


@pytest.mark.torchvision
def test_a_video_given_to_the_api_in_memory_has_its_sound_track_checked_as_a_files(app):
    video = Video(np.zeros((4, 64, 64, 3), np.uint8), fps=2.0, audio=np.full(32_000, np.nan, np.float32))
    session = app.session()
    message = "videos[0]: the sound track holds NaN or infinite samples (corrupt audio)"
    with pytest.raises(MediaError, match=exactly(message)):
        session.send("What happens here?", videos=[video])
    assert session.history == []


def video_with_float_track(track: np.ndarray) -> bytes:
    """A MOV of ten black frames whose sound track is `track` (16 kHz mono), kept as raw floats."""
    out = io.BytesIO()
    with av.open(out, "w", format="mov") as file:
        video = file.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = file.add_stream("pcm_f32le", rate=SAMPLE_RATE)
        black = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
        for _ in range(10):
            file.mux(video.encode(black))
        file.mux(video.encode())
        sound = av.AudioFrame.from_ndarray(track[None], format="flt", layout="mono")
        sound.sample_rate = SAMPLE_RATE
        file.mux(audio.encode(sound))
        file.mux(audio.encode())
    return out.getvalue()
