"""A checkpoint in Qwen's own older file layout, sharded, loads and answers exactly as the demo does;
one whose video processor is a placeholder or missing loads, answers all but video, and refuses a
video saying why."""

import json
import re
import shutil

import pytest
from transformers.video_processing_utils import VideoProcessorMixin

from checkpoint_layouts import OFFICIAL_SHARDS, write_older_layout, write_with_video_processor
from replies import NEW_TOKENS, media, reference_tokens
from samples import clip, picture, video_file
from omni_local.api import OmniLocal
from omni_local.errors import CheckpointError, MediaError
from omni_local.model import load_model
from omni_local.model import workarounds
from omni_local.model.workarounds import NO_TORCHVISION, ProcessorWithoutVideo, video_refusal
from omni_local.protocol.messages import Message

SYSTEM = "You are a helpful assistant."
QUESTIONS = {
    "text": lambda: ["Tell me a story about a lighthouse keeper."],
    "image": lambda: [picture(1), "What is in this picture?"],
    "image and audio": lambda: [picture(3, (224, 224)), clip(4, 3.0), "Describe both."],
}
# What a copy saved where torchvision was missing has in its video processor's place, and the phrase a
# video sent to it is refused with. transformers saves a stand-in's class name alone.
VIDEO_PROCESSORS_RECORDED = {
    "transformers' own stand-in": (lambda demo: VideoProcessorMixin(),
                                   "records a placeholder video processor (VideoProcessorMixin)"),
    "omni_local's stand-in": (lambda demo: ProcessorWithoutVideo.from_pretrained(demo).video_processor,
                              "records a placeholder video processor (_NoVideoProcessor)"),
    "none": (lambda demo: None, "records no video processor"),
}


def _reply(app: OmniLocal, parts: list) -> list[int]:
    session = app.session(system_prompt=SYSTEM)
    return session.send(text=parts[-1], **media(parts), max_new_tokens=NEW_TOKENS).result().token_ids


def _messages(parts: list) -> list[Message]:
    return [Message("system", [SYSTEM]), Message("user", parts)]


@pytest.fixture(scope="module")
def older_layout(demo_checkpoint, tmp_path_factory):
    return write_older_layout(demo_checkpoint, tmp_path_factory.mktemp("layouts") / "older")


@pytest.fixture(scope="module")
def older_app(demo_settings, older_layout):
    with OmniLocal(demo_settings.replace(model=str(older_layout))) as app:
        yield app


@pytest.fixture(scope="module", params=VIDEO_PROCESSORS_RECORDED)
def without_video(request, demo_settings, demo_checkpoint, tmp_path_factory):
    """The app on a copy of the demo saved with `request.param`'s video processor, and the phrase a
    video sent to it is refused with."""
    stand_in, phrase = VIDEO_PROCESSORS_RECORDED[request.param]
    path = tmp_path_factory.mktemp("video") / "copy"
    write_with_video_processor(demo_checkpoint, path, stand_in(demo_checkpoint))
    with OmniLocal(demo_settings.replace(model=str(path))) as app:
        yield app, phrase


# The older layout


def test_the_older_layout_has_the_files_of_qwens_own_instruct_checkpoint(older_layout):
    shards = {f"model-{n:05d}-of-{OFFICIAL_SHARDS:05d}.safetensors" for n in range(1, OFFICIAL_SHARDS + 1)}
    assert {p.name for p in older_layout.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors.index.json", *shards,
        "vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json", "chat_template.json",
    }


def test_the_older_layout_is_identical_when_written_twice(demo_checkpoint, older_layout, tmp_path):
    again = write_older_layout(demo_checkpoint, tmp_path / "again")
    for path in older_layout.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_the_older_layouts_tokenizer_reads_and_writes_text_as_the_demos(older_app, demo_model):
    older, demo = older_app.backend.loaded.processor.tokenizer, demo_model.processor.tokenizer
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi, 42 cats!<think>x</think><|im_end|>\n"
    assert older.get_vocab() == demo.get_vocab()
    assert older.encode(text) == demo.encode(text)
    for skip in (False, True):
        ids = demo.encode(text)
        assert older.decode(ids, skip_special_tokens=skip) == demo.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_older_layout_sharded_matches_transformers_generate_and_the_demo(older_app, app, question):
    parts = QUESTIONS[question]()
    reply = _reply(older_app, parts)
    assert reply, "the reply must not be empty, or the comparison proves little"
    assert reply == reference_tokens(older_app, _messages(parts))
    assert reply == _reply(app, parts)


OLDER_LAYOUT_FILES_MISSING = {
    "vocab.json": "tokenizer vocabulary (tokenizer.json, or vocab.json and merges.txt)",
    "merges.txt": "tokenizer vocabulary (tokenizer.json, or vocab.json and merges.txt)",
    "tokenizer_config.json": "missing tokenizer_config.json",
    "preprocessor_config.json": "processor settings (processor_config.json or preprocessor_config.json)",
    "chat_template.json": "chat template (chat_template.jinja or chat_template.json)",
    "model-00007-of-00015.safetensors": "weight shard model-00007-of-00015.safetensors (named in "
                                        "model.safetensors.index.json)",
}


@pytest.mark.parametrize("name", OLDER_LAYOUT_FILES_MISSING,
                         ids=[f"missing {name} is named" for name in OLDER_LAYOUT_FILES_MISSING])
def test_an_incomplete_checkpoint_in_the_older_layout_is_refused_naming_what_is_missing(
    name, demo_settings, older_layout, tmp_path
):
    path = shutil.copytree(older_layout, tmp_path / "broken")
    (path / name).unlink()
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path)))
    assert OLDER_LAYOUT_FILES_MISSING[name] in str(raised.value)
    assert str(path.resolve()) in str(raised.value)


# A placeholder or missing video processor


def test_transformers_saves_a_stand_in_video_processor_as_its_class_name_alone(demo_checkpoint, tmp_path):
    path = write_with_video_processor(demo_checkpoint, tmp_path / "copy", VideoProcessorMixin())
    recorded = json.loads((path / "processor_config.json").read_text(encoding="utf-8"))["video_processor"]
    assert recorded == {"video_processor_type": "VideoProcessorMixin"}


@pytest.mark.parametrize("question", ["text", "image"])
def test_a_checkpoint_without_a_video_processor_answers_text_and_images_as_transformers_does(
    without_video, question
):
    app, _ = without_video
    parts = QUESTIONS[question]()
    assert not app.backend.info.video
    reply = _reply(app, parts)
    assert reply and reply == reference_tokens(app, _messages(parts))


@pytest.mark.torchvision  # without torchvision the refusal says torchvision is missing, whatever the checkpoint
def test_a_checkpoint_without_a_video_processor_refuses_a_video_saying_why(without_video, tmp_path):
    app, phrase = without_video
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_file(7))
    session = app.session()
    with pytest.raises(MediaError, match=re.escape(f"video input is not available: checkpoint 'copy' {phrase}")):
        session.send("What happens in this video?", videos=[path])
    assert session.send("Hello", max_new_tokens=2).result().token_ids


@pytest.mark.parametrize("recorded", VIDEO_PROCESSORS_RECORDED)
def test_without_torchvision_a_copy_without_a_video_processor_loads_and_refuses_video_for_that(
    recorded, demo_settings, demo_checkpoint, monkeypatch, tmp_path
):
    # What `load_processor` loads where torchvision is missing, whether or not it is missing here.
    monkeypatch.setattr(workarounds, "is_torchvision_available", lambda: False)
    stand_in, _ = VIDEO_PROCESSORS_RECORDED[recorded]
    path = write_with_video_processor(demo_checkpoint, tmp_path / "copy", stand_in(demo_checkpoint))
    processor = load_model(demo_settings.replace(model=str(path))).processor
    assert video_refusal(processor) == NO_TORCHVISION
    inputs = processor(text="<|vision_start|><|image_pad|><|vision_end|>", images=[picture(2)], return_tensors="pt")
    assert inputs["image_grid_thw"].shape == (1, 3)
