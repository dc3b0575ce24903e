"""Video questions: a clip's frames and sound track are read as transformers' own processor and
`generate` read them, a resent video is answered from the cache with the same tokens, and a bad
file is a clear error."""

import io
import re
import struct

import av
import numpy as np
import pytest
import torch
from PIL import Image

from chats import Chat, common_prefix, written
from samples import clip, picture, video_file
from omni_local.api import OmniLocal
from omni_local.engine.prompt.builder import build_prompt, video_grid
from omni_local.errors import MediaError
from omni_local.media.limits import MediaLimits
from omni_local.media.video import DECODING_SLACK_SECONDS, Video, load_video
from omni_local.metrics_line import metrics_line
from omni_local.model import workarounds
from omni_local.protocol.messages import Message

NEW_TOKENS = 12
QUESTION = "What happens in this video?"
SYSTEM = "You watch videos."


def transformers_reply(
    app: OmniLocal, messages: list[Message], text_parts: list[dict]
) -> tuple[torch.Tensor, list[int]]:
    """The prompt ids and greedy reply of transformers' own processor and `generate` (the video's
    sound track loaded as its audio, `use_audio_in_video`), the pixels made on the model's device as
    the engine makes them (on CUDA a resize rounds otherwise than on the CPU)."""
    processor, device = app.backend.loaded.processor, app.backend.loaded.device
    text = processor.apply_chat_template([{"role": "user", "content": text_parts}], tokenize=False,
                                         add_generation_prompt=True)
    videos = [p for m in messages for p in m.videos()]
    # Every sound in prompt order, each video's track marked as that video's.
    with_sound = [p for m in messages for p in m.parts if isinstance(p, Video | np.ndarray)]
    sounds = [p.audio if isinstance(p, Video) else p for p in with_sound]
    sources = [videos.index(p) if isinstance(p, Video) else None for p in with_sound]
    inputs = processor(text=text, videos=[v.frames for v in videos], audio=sounds, audio_from_video_indices=sources,
                       load_audio_from_video=True, images=[p for m in messages for p in m.images()] or None,
                       images_kwargs={"device": device},
                       videos_kwargs={"fps": videos[0].fps, "do_sample_frames": False, "device": device},
                       return_tensors="pt")
    inputs.pop("num_audio_tokens", None)
    ids = inputs["input_ids"]
    with torch.inference_mode():
        output = app.backend.loaded.model.thinker.generate(**inputs.to(device), use_audio_in_video=True,
                                                           max_new_tokens=NEW_TOKENS, do_sample=False,
                                                           suppress_tokens=app.backend.engine.suppressed_ids)
    reply = [t for t in output[0, ids.shape[1]:].tolist() if t not in app.backend.engine.eos_ids]
    return ids, reply


CASES = {
    "a clip with sound": lambda app: ([app.read_video(video_file(1))], [{"type": "video"}]),
    # In the order `send` puts a message's parts: images, sounds, videos.
    "an image, a sound and a clip": lambda app: (
        [picture(2), clip(4), app.read_video(video_file(3, seconds=1.0))],
        [{"type": "image"}, {"type": "audio"}, {"type": "video"}],
    ),
}


@pytest.mark.torchvision
@pytest.mark.parametrize("case", CASES)
def test_a_video_question_has_the_prompt_and_reply_of_transformers(apps, case):
    app = apps[1]
    parts, blocks = CASES[case](app)
    messages = [Message("user", [*parts, QUESTION])]
    ids, expected = transformers_reply(app, messages, [*blocks, {"type": "text", "text": QUESTION}])
    assert torch.equal(build_prompt(messages, app.backend.loaded.processor).input_ids, ids)
    videos = [p for p in parts if isinstance(p, Video)]
    images = [p for p in parts if isinstance(p, Image.Image)]
    audio = [p for p in parts if isinstance(p, np.ndarray)]
    final = app.session().send(QUESTION, images=images, audio=audio, videos=videos, max_new_tokens=NEW_TOKENS).result()
    assert final.token_ids == expected and final.token_ids


def test_a_two_second_clip_is_read_at_two_frames_a_second_with_its_sound_at_16_khz():
    video = load_video(video_file(5, seconds=2.0), MediaLimits(50 << 20, 4096 * 4096, 300, 120), fps=2.0)
    assert video.frames.shape == (4, 64, 96, 3) and video.fps == pytest.approx(2.0)
    assert video.audio is not None and abs(video.audio.size - 32_000) < 2_000  # AAC adds a little padding


@pytest.mark.parametrize("container", ["mov", "webm"])
def test_mov_and_webm_are_read_too(container):
    video = load_video(video_file(6, container=container), MediaLimits(50 << 20, 4096 * 4096, 300, 120), fps=2.0)
    assert video.frames.shape[0] == 4 and video.audio is not None


@pytest.mark.torchvision
def test_a_silent_clip_gets_a_silent_track_so_every_video_is_laid_out_alike(apps):
    video = apps[0].read_video(video_file(7, sound=False))
    assert video.audio is not None and not video.audio.any()
    assert video.audio.size == round(video.seconds * 16_000)


@pytest.mark.torchvision
def test_the_same_video_with_a_new_question_computes_only_the_new_question(apps):
    video = apps[0].read_video(video_file(8))
    Chat(apps, SYSTEM, NEW_TOKENS).send(QUESTION, videos=[video])
    chat = Chat(apps, SYSTEM, NEW_TOKENS)
    before = build_prompt([Message("system", [SYSTEM]), Message("user", [video, QUESTION])],
                          apps[0].backend.loaded.processor)
    ids = build_prompt([Message("system", [SYSTEM]), Message("user", [video, "Who is in it?"])],
                       apps[0].backend.loaded.processor)
    final = chat.send("Who is in it?", videos=[video])
    shared = common_prefix(before.input_ids[0].tolist(), ids.input_ids[0].tolist())
    assert final.tokens.computed == ids.num_tokens - shared
    assert shared > ids.media[0].end  # the whole video, frames and sound, came from the cache


@pytest.mark.torchvision
def test_a_video_chat_turn_2_computes_only_turn_2(apps):
    chat = Chat(apps, SYSTEM, NEW_TOKENS)
    first = chat.send(QUESTION, videos=[apps[0].read_video(video_file(9))])
    second = chat.send("And then?")
    assert second.tokens.computed == second.tokens.prompt - written(first)


@pytest.mark.torchvision
def test_a_known_video_skips_its_encoders(apps, monkeypatch):
    app = apps[0]
    video = app.read_video(video_file(10))
    app.session().send(QUESTION, videos=[video], max_new_tokens=2).result()
    encoders = app.backend.engine.runner.encoder.encoders
    calls = []
    monkeypatch.setattr(encoders, "images", lambda *a: calls.append("frames"))
    monkeypatch.setattr(encoders, "audio", lambda *a: calls.append("sound"))
    # Another system prompt first, so the video is not in any cached KV prefix: only the encoder
    # cache can spare its encoders.
    final = app.session("Another chat.").send("Describe it.", videos=[video], max_new_tokens=2).result()
    assert calls == []
    assert (final.media.encoded, final.media.from_cache) == (0, 1)
    assert "1 from the encoder cache" in metrics_line(final)


LIMITS = MediaLimits(max_upload_bytes=50 << 20, max_image_pixels=96 * 64, max_audio_seconds=300, max_video_seconds=3.0)


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        (lambda: video_file(11)[:2000], "not a readable video file (MP4, WebM or MOV expected; or truncated)"),
        (lambda: b"not a video at all" * 100, "not a readable video file"),
        (lambda: video_file(16, frames=False), "has no video stream"),
        (lambda: video_file(12, seconds=4.0), "4.1 s is over the limit of 3 s (max_video_seconds)"),
        (lambda: video_file(13, size=(128, 64)), "over the limit of 6,144 pixels (max_image_pixels)"),
    ],
    ids=["truncated", "not a video", "sound only", "too long", "too large"],
)
def test_a_bad_video_is_read_as_a_clear_media_error(data, phrase):
    with pytest.raises(MediaError, match=re.escape(phrase)):
        load_video(data(), LIMITS, fps=2.0, name="clip.mp4")


def long_clip_with_a_lying_header(frame_seconds: int, sound_seconds: int, claimed: int) -> bytes:
    """An MP4 of 32×32 black frames at 10 fps and silence at 16 kHz whose headers (the movie's, each
    track's) say it lasts `claimed` seconds; its sample tables, which FFmpeg reads, hold it all."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as file:
        video, audio = file.add_stream("mpeg4", rate=10), file.add_stream("aac", rate=16_000)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        black = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for _ in range(frame_seconds * 10):
            file.mux(video.encode(black))
        file.mux(video.encode())
        for second in range(sound_seconds):
            silence = av.AudioFrame.from_ndarray(np.zeros((1, 16_000), np.float32), format="fltp", layout="mono")
            silence.sample_rate, silence.pts = 16_000, second * 16_000
            file.mux(audio.encode(silence))
        file.mux(audio.encode())
    data = bytearray(out.getvalue())
    # Version 0 boxes: mvhd and mdhd hold their timescale at +16 and duration at +20 (from the box's
    # name); tkhd its duration at +24, in the movie's timescale (FFmpeg's, 1000).
    for box, duration_at, timescale_at in ((b"mvhd", 20, 16), (b"mdhd", 20, 16), (b"tkhd", 24, None)):
        at = data.find(box)
        while at >= 0:
            timescale = struct.unpack(">I", data[at + timescale_at:at + timescale_at + 4])[0] if timescale_at else 1000
            data[at + duration_at:at + duration_at + 4] = struct.pack(">I", claimed * timescale)
            at = data.find(box, at + 4)
    return bytes(data)


class CountingContainer:
    """An open container that counts the seconds decoded from each kind of stream."""

    def __init__(self, container: av.container.InputContainer) -> None:
        self._container = container
        self.seconds = {"video": 0.0, "audio": 0.0}

    def __getattr__(self, name: str):
        return getattr(self._container, name)

    def __enter__(self) -> "CountingContainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self._container.close()

    def decode(self, stream):
        for frame in self._container.decode(stream):
            self.seconds[stream.type] += frame.samples / frame.sample_rate if stream.type == "audio" else 0.1
            yield frame


@pytest.mark.parametrize(
    ("frame_seconds", "message"),
    [(2, "clip.mp4: the sound track runs past the limit of 3 s (max_video_seconds), though the file says it "
         "lasts 2.0 s"),
     (60, "clip.mp4: the video stream runs past the limit of 3 s (max_video_seconds), though the file says it "
          "lasts 2.0 s")],
    ids=["sound", "frames and sound"],
)
def test_a_clip_whose_header_says_less_than_it_holds_stops_decoding_at_the_limit(monkeypatch, frame_seconds, message):
    data = long_clip_with_a_lying_header(frame_seconds, sound_seconds=60, claimed=2)
    opened: list[CountingContainer] = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *args, **kwargs: opened.append(CountingContainer(real_open(*args, **kwargs)))
                        or opened[-1])
    with pytest.raises(MediaError, match=f"^{re.escape(message)}$"):
        load_video(data, LIMITS, fps=2.0, name="clip.mp4")
    most = LIMITS.max_video_seconds + DECODING_SLACK_SECONDS + 1  # a packet beyond what the check allows
    assert opened[0].seconds["video"] <= most and opened[0].seconds["audio"] <= most, opened[0].seconds


@pytest.mark.torchvision
def test_a_bad_video_through_the_api_is_a_media_error_naming_the_file_and_the_next_question_is_served(
    apps, tmp_path
):
    path = tmp_path / "broken.mp4"
    path.write_bytes(video_file(14)[:1500])
    session = apps[0].session()
    with pytest.raises(MediaError, match="broken.mp4: not a readable video file"):
        session.send(QUESTION, videos=[path])
    assert session.send("Hello", max_new_tokens=2).result().token_ids


def test_without_torchvision_a_video_is_refused_saying_so_and_images_are_still_answered(
    demo_settings, demo_checkpoint, monkeypatch, tmp_path
):
    # The app `load_processor` loads where torchvision is missing, whether or not it is missing here.
    monkeypatch.setattr(workarounds, "is_torchvision_available", lambda: False)
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_file(15))
    with OmniLocal(demo_settings) as app:
        session = app.session()
        with pytest.raises(MediaError, match="video input needs torchvision, which is not installed here"):
            session.send(QUESTION, videos=[path])
        assert session.send("What is this?", images=[picture(16)], max_new_tokens=2).result().token_ids


@pytest.mark.torchvision
@pytest.mark.parametrize("shape", [(4, 64, 96), (20, 360, 640), (8, 1080, 1920), (6, 40, 500), (200, 64, 64)], ids=str)
def test_the_grid_a_prompt_is_built_with_is_the_video_processors(demo_model, shape):
    # The prompt is built from the frames' shape alone; the pixels come later, from the processor.
    frames = np.zeros((*shape, 3), np.uint8)
    processor = demo_model.processor.video_processor
    expected = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")["video_grid_thw"][0]
    assert video_grid(Video(frames, 2.0, None), processor) == tuple(expected.tolist())
