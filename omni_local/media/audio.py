"""Decoding an uploaded sound file into the 16 kHz mono float32 samples the audio encoder takes."""

import io
from pathlib import Path

import numpy as np
import soundfile
import soxr

from omni_local.errors import MediaError
from omni_local.media.limits import MediaLimits, tenths
from omni_local.media.upload import read_upload

SAMPLE_RATE = 16_000
# libsndfile's names; WAVEX and RF64 are WAV files with extended headers.
ACCEPTED_FORMATS = ("WAV", "WAVEX", "RF64", "FLAC", "OGG", "MP3")
_EXPECTED = "WAV, FLAC, OGG or MP3 expected"
# The audio encoder's mel window (400 samples, centred on each hop) needs more than half its width.
MIN_SAMPLES = 201
# The most channels an array given in memory may have (7.1 sound): the channel axis of a 2-D array is
# the one this short, which tells soundfile's (samples, channels) from torchaudio's (channels, samples).
MAX_CHANNELS = 8
# Sound at full scale is within [-1, 1]; a float file may peak above it (float formats keep what an
# integer one would clip), but not 16 times over (+24 dB): such numbers are corrupt data or the wrong
# scale (16-bit values saved as floats reach 32,768), not sound the encoder was made for.
MAX_PEAK = 16.0


def load_audio(source: str | Path | bytes, limits: MediaLimits, name: str | None = None) -> np.ndarray:
    """The clip as float32 samples in [-1, 1] (for integer formats), mono, at 16 kHz; shape (samples,).

    Raises `MediaError` for a missing, empty, oversized, unsupported, corrupt or too short file, and
    for samples that are not sound (see `check_samples`).
    """
    upload = read_upload(source, limits, name)
    try:
        sound = soundfile.SoundFile(io.BytesIO(upload.data))
    # libsndfile answers every unreadable header alike ("Format not recognised" and kin).
    except Exception:
        raise MediaError(f"{upload.name}: not an audio file ({_EXPECTED})") from None
    with sound:
        if sound.format not in ACCEPTED_FORMATS:
            raise MediaError(f"{upload.name}: {sound.format} audio is not supported ({_EXPECTED})")
        check_duration(upload.name, sound.frames / sound.samplerate, limits)
        try:
            # soundfile reads no more frames than the header's count, checked just above.
            samples = sound.read(dtype="float32", always_2d=True)  # (frames, channels)
        except Exception:
            raise MediaError(f"{upload.name}: the file is truncated or corrupt (not readable audio)") from None
        rate = sound.samplerate
    mono = samples.mean(axis=1)
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE)
    # Checked after resampling: a clip of a few samples at a high rate can come out empty.
    check_samples(upload.name, mono)
    return np.ascontiguousarray(mono, dtype=np.float32)


def samples_from_array(name: str, array: np.ndarray, limits: MediaLimits) -> np.ndarray:
    """Samples given in memory (16 kHz) as the audio encoder takes them: float32, mono, checked as a
    file's are. One dimension is one channel; two are (samples, channels), as soundfile reads them,
    or (channels, samples), as torchaudio does: the channel axis is the one of at most MAX_CHANNELS,
    and the channels are averaged into one, as a file's are. Any other shape is refused."""
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise MediaError(f"{name}: expected an array of numbers (samples), got an array of {array.dtype}")
    channel_axis = _channel_axis(name, array.shape)
    frames = array.shape[1 - channel_axis] if channel_axis is not None else len(array)
    check_duration(name, frames / SAMPLE_RATE, limits)  # before any copy is made of a long array
    samples = array.astype(np.float32)
    if channel_axis is not None:
        samples = samples.mean(axis=channel_axis)
    check_samples(name, samples)  # a NaN would make every output of the model NaN
    return np.ascontiguousarray(samples)


def _channel_axis(name: str, shape: tuple[int, ...]) -> int | None:
    """Which axis of an array of `shape` holds its channels; None for one dimension, one channel."""
    if len(shape) == 1:
        return None
    if len(shape) != 2:
        raise MediaError(f"{name}: an array of {len(shape)} dimensions is not samples (one dimension, or two "
                         "with channels)")
    short = [axis for axis, size in enumerate(shape) if size <= MAX_CHANNELS]
    if len(short) != 1:
        raise MediaError(f"{name}: an array of shape {shape} is not (samples, channels) or (channels, samples) "
                         f"with at most {MAX_CHANNELS} channels")
    return short[0]


def check_samples(name: str, samples: np.ndarray, what: str = "the clip") -> None:
    """Refuse 16 kHz mono samples the audio encoder cannot take: none, too few for its window (a
    file cut short after its header holds a few), or numbers that are not sound: NaN, infinite, or
    far outside [-1, 1]. A NaN makes the model's every output NaN."""
    if len(samples) == 0:
        raise MediaError(f"{name}: {what} has no audio (zero samples)")
    if len(samples) < MIN_SAMPLES:
        count = f"{len(samples)} sample{'s' if len(samples) > 1 else ''}"
        raise MediaError(f"{name}: {what} is too short for the model ({count}, under 13 ms)")
    peak = float(np.abs(samples).max())  # NaN or infinite where any sample is
    if not np.isfinite(peak):
        raise MediaError(f"{name}: {what} holds NaN or infinite samples (corrupt audio)")
    if peak > MAX_PEAK:
        shown = f"{peak:,.0f}" if peak < 1e9 else f"{peak:.1e}"
        raise MediaError(f"{name}: {what}'s samples reach {shown}, far outside [-1, 1] "
                         "(corrupt or wrongly scaled audio)")


def check_duration(name: str, seconds: float, limits: MediaLimits) -> None:
    if seconds > limits.max_audio_seconds:
        raise MediaError(
            f"{name}: {tenths(seconds, up=True)} s is over the limit of "
            f"{tenths(limits.max_audio_seconds, up=False)} s (max_audio_seconds)"
        )
