"""Decoding an uploaded video (MP4, WebM, MOV) into sampled RGB frames and its 16 kHz mono audio track.

PyAV (FFmpeg's libraries, bundled in its wheel) decodes the container. Frames are sampled
uniformly at `fps` frames per second, as transformers' Qwen2-VL video processor samples them:
at least `min_frames`, at most `max_frames`, an even count (two frames make one temporal patch).
Resizing to the model's pixel budget is the video processor's work, later. The limits are checked
against the header before decoding, and against what is decoded as it is decoded (a header can say
2 s of a file that holds 900 s): decoding stops at the first frame past them.
"""

import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from omni_local.errors import MediaError
from omni_local.media.audio import SAMPLE_RATE, check_samples
from omni_local.media.image import check_shape
from omni_local.media.limits import MediaLimits, tenths
from omni_local.media.upload import Upload, read_upload

ACCEPTED_FORMATS = ("mp4", "mov", "matroska", "webm")  # FFmpeg's demuxer names (MP4 and MOV share one)
_EXPECTED = "MP4, WebM or MOV expected"
TEMPORAL_PATCH = 2  # frames per temporal patch of Qwen3-Omni's vision encoder
# How far past max_video_seconds a stream may decode before it is refused: codecs pad a stream's
# last frame (AAC its first too), so a clip within the limit can decode a little longer than it lasts.
DECODING_SLACK_SECONDS = 1.0


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB, T even
    fps: float  # frames per second of `frames`
    audio: np.ndarray | None  # the sound track: 16 kHz mono float32, or None for a silent clip
    name: str = "video"  # what errors call it: the Python API names the argument ("videos[0]")

    @property
    def seconds(self) -> float:
        return len(self.frames) / self.fps


@dataclass(frozen=True)
class DecodingBound:
    """max_video_seconds applied to what is decoded, as it is decoded: the header's duration, checked
    before, is only what the file says, and a stream can hold far more (a sample table of 900 s
    under a header of 2 s). Decoding stops at the first frame past the bound."""

    name: str  # the file's, for the error
    limit: float  # max_video_seconds
    claimed: float  # the duration the header says

    def check(self, seconds: float, what: str) -> None:
        """Refuse `what` ("the sound track"), decoded up to `seconds` so far, once it is past the limit."""
        if seconds > self.limit + DECODING_SLACK_SECONDS:
            raise MediaError(f"{self.name}: {what} runs past the limit of {tenths(self.limit, up=False)} s "
                             f"(max_video_seconds), though the file says it lasts {tenths(self.claimed, up=True)} s")


@dataclass(frozen=True)
class VideoFile:
    """A video file, checked but not decoded: what a remote backend sends on as it is."""

    data: bytes
    name: str
    seconds: float


def load_video(
    source: str | Path | bytes, limits: MediaLimits, fps: float, min_frames: int = 4, max_frames: int = 768,
    name: str | None = None,
) -> Video:
    """The clip's frames sampled at `fps` and its audio track; `MediaError` for anything unreadable,
    a file with no video stream, or a clip over the limits."""
    upload = read_upload(source, limits, name)
    with _opened(upload, limits) as container:
        stream = container.streams.video[0]
        native_fps = float(stream.average_rate or stream.guessed_rate or fps)
        total = stream.frames or round((container.duration or 0) / av.time_base * native_fps)
        picked = _sample(max(total, 1), native_fps, fps, min_frames, max_frames)
        bound = DecodingBound(upload.name, limits.max_video_seconds, _claimed_seconds(container))
        try:
            frames = _decode_frames(container, stream, picked, bound, native_fps)
            container.seek(0)
            audio = _audio_track(container, bound)
        except av.FFmpegError:
            raise MediaError(f"{upload.name}: the file is truncated or corrupt (not a readable video)") from None
    if not frames:
        raise MediaError(f"{upload.name}: the video stream has no frames")
    if audio is not None:
        check_samples(upload.name, audio, "the sound track")
    # The sampled frames span the clip, so their count over its length is what places them in time.
    sampled_fps = len(picked) * native_fps / max(total, 1)
    return Video(np.stack(frames), sampled_fps, audio)


def read_video_file(source: str | Path | bytes, limits: MediaLimits, name: str | None = None) -> VideoFile:
    """The clip's file as it is, checked as `load_video` checks it (container, video stream, limits)
    but not decoded: for a backend that decodes it elsewhere."""
    upload = read_upload(source, limits, name)
    with _opened(upload, limits) as container:
        seconds = _claimed_seconds(container)
    return VideoFile(upload.data, upload.name, seconds)


def _claimed_seconds(container: av.container.InputContainer) -> float:
    """The clip's duration as its header says (0 where it says none)."""
    return container.duration / av.time_base if container.duration else 0.0


def _opened(upload: Upload, limits: MediaLimits) -> av.container.InputContainer:
    """The upload as an open container of an accepted format with a video stream within the limits."""
    try:
        container = av.open(io.BytesIO(upload.data))
    except av.FFmpegError:
        raise MediaError(f"{upload.name}: not a readable video file ({_EXPECTED}; or truncated)") from None
    try:
        if not set(container.format.name.split(",")) & set(ACCEPTED_FORMATS):
            raise MediaError(f"{upload.name}: {container.format.long_name} is not supported ({_EXPECTED})")
        if not container.streams.video:
            raise MediaError(f"{upload.name}: the file has no video stream")
        _check_limits(upload.name, container, container.streams.video[0], limits)
    except MediaError:
        container.close()
        raise
    return container


def _decode_frames(container: av.container.InputContainer, stream: av.VideoStream, picked: np.ndarray,
                   bound: DecodingBound, native_fps: float) -> list:
    """The frames at the `picked` indices, decoding once and keeping only those (a long clip's every
    frame would not fit in memory), within `bound`; if the stream holds fewer frames than its header
    says, its last frame stands in for the missing ones."""
    slots: dict[int, list[int]] = {}
    for n, index in enumerate(picked):
        slots.setdefault(int(index), []).append(n)
    kept: list[np.ndarray | None] = [None] * len(picked)
    last = None
    for index, frame in enumerate(container.decode(stream)):
        bound.check(frame.time if frame.time is not None else index / native_fps, "the video stream")
        last = frame
        for n in slots.get(index, []):
            kept[n] = frame.to_ndarray(format="rgb24")
        if index >= picked[-1]:
            break
    if last is None:
        return []
    fill = last.to_ndarray(format="rgb24")
    return [k if k is not None else fill for k in kept]


def _check_limits(name: str, container: av.container.InputContainer, stream: av.VideoStream,
                  limits: MediaLimits) -> None:
    """The limits as the header says the clip is; what is decoded is held to them as it is (`DecodingBound`)."""
    seconds = _claimed_seconds(container)
    if seconds > limits.max_video_seconds:
        raise MediaError(
            f"{name}: {tenths(seconds, up=True)} s is over the limit of "
            f"{tenths(limits.max_video_seconds, up=False)} s (max_video_seconds)"
        )
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"{name}: frames of {width}x{height} are over the limit of {limits.max_image_pixels:,} pixels "
            "(max_image_pixels)"
        )
    check_shape(name, width, height, "each frame")


def _sample(total: int, native_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Uniform frame indices: `fps` per second within [min_frames, max_frames], an even count; a
    clip shorter than that repeats its last frame."""
    wanted = total / native_fps * fps
    count = max(min(max(wanted, min_frames), max_frames), TEMPORAL_PATCH)
    count = int(count // TEMPORAL_PATCH * TEMPORAL_PATCH)
    return np.linspace(0, total - 1, count).round().astype(int)


def _audio_track(container: av.container.InputContainer, bound: DecodingBound) -> np.ndarray | None:
    if not container.streams.audio:
        return None
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    pieces, seconds = [], 0.0
    for frame in container.decode(container.streams.audio[0]):
        seconds += frame.samples / frame.sample_rate  # counted, not read from timestamps, which can lie too
        bound.check(seconds, "the sound track")
        pieces += [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
    pieces += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return samples.astype(np.float32) if samples.size else None
