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


def load_audio(source: str | Path | bytes, limits: MediaLimits, name: str | None = None) -> np.ndarray:
    """The clip as float32 samples in [-1, 1] (for integer formats), mono, at 16 kHz; shape (samples,).

    Raises `MediaError` for a missing, empty, oversized, unsupported, corrupt or zero-length file.
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
    if len(mono) == 0:
        raise MediaError(f"{upload.name}: the clip has no audio (zero samples)")
    return np.ascontiguousarray(mono, dtype=np.float32)


def check_duration(name: str, seconds: float, limits: MediaLimits) -> None:
    if seconds > limits.max_audio_seconds:
        raise MediaError(
            f"{name}: {tenths(seconds, up=True)} s is over the limit of "
            f"{tenths(limits.max_audio_seconds, up=False)} s (max_audio_seconds)"
        )
