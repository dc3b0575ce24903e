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
