"""Loading Qwen3-Omni: the built-in demo checkpoint, checkpoint validation, speech on and off."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from omni_local.model.workarounds import ProcessorWithoutVideo, video_supported
from omni_local.errors import CheckpointError, MediaError, SettingsError
from omni_local.model import LoadedModel, load_model, thinker_eos_token_ids
from omni_local.model import demo
from omni_local.model.demo import MARKER_FILE, ensure_demo_checkpoint
from omni_local.model.loader import resolve_device, resolve_dtype
from omni_local.settings import Settings

SYSTEM = {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]}


def _user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(width: int = 96, height: int = 64, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _audio(seconds: float = 1.0, hertz: float = 440.0) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * hertz * t)).astype(np.float32)


def _inputs(loaded: LoadedModel, messages: list[dict], **media: list) -> dict:
    processor = loaded.processor
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=text, return_tensors="pt", **media)


def _greedy_reply(loaded: LoadedModel, inputs: dict, max_new_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        output = loaded.model.thinker.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def _copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _speech_settings(demo_settings: Settings) -> Settings:
    return demo_settings.replace(speech=True)


# The demo checkpoint


def test_demo_checkpoint_is_identical_when_built_twice(tmp_path: Path) -> None:
    first = ensure_demo_checkpoint(tmp_path / "a" / "demo")
    second = ensure_demo_checkpoint(tmp_path / "b" / "demo")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_demo_checkpoint_is_a_few_megabytes(demo_checkpoint: Path) -> None:
    size = sum(p.stat().st_size for p in demo_checkpoint.iterdir())
    assert size < 8 << 20


def test_demo_checkpoint_is_reused_when_complete(demo_checkpoint: Path) -> None:
    weights = demo_checkpoint / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_demo_checkpoint(demo_checkpoint) == demo_checkpoint
    assert weights.stat().st_mtime_ns == before


def test_demo_checkpoint_is_rebuilt_when_built_by_another_version(tmp_path: Path) -> None:
    path = ensure_demo_checkpoint(tmp_path / "demo")
    (path / MARKER_FILE).write_text(json.dumps({"builder_version": "0"}), encoding="utf-8")
    (path / "stale.txt").write_text("left by an old builder", encoding="utf-8")
    ensure_demo_checkpoint(path)
    assert json.loads((path / MARKER_FILE).read_text())["builder_version"] == demo.BUILDER_VERSION
    assert not (path / "stale.txt").exists()


def test_interrupted_demo_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(folder: Path, size: object) -> None:
        (folder / "config.json").write_text("{}", encoding="utf-8")
        raise RuntimeError("power cut")

    monkeypatch.setattr(demo, "_write_checkpoint", crash)
    with pytest.raises(RuntimeError):
        ensure_demo_checkpoint(tmp_path / "demo")
    assert list(tmp_path.iterdir()) == []


def test_demo_tokenizer_defines_every_special_token_of_qwen3_omni(demo_model: LoadedModel) -> None:
    tokenizer = demo_model.processor.tokenizer
    vocab = tokenizer.get_vocab()
    assert all(token in vocab for token in demo._SPECIAL_TOKENS)
    for word in ("system", "user", "assistant"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1
    encoded = tokenizer.encode("<|im_start|>user\nhello<|im_end|>", add_special_tokens=False)
    assert encoded[0] == vocab["<|im_start|>"] and encoded[-1] == vocab["<|im_end|>"]


def test_demo_config_token_ids_match_the_tokenizer(demo_model: LoadedModel) -> None:
    vocab = demo_model.processor.tokenizer.get_vocab()
    config = demo_model.model.config
    thinker = config.thinker_config
    assert thinker.image_token_id == vocab["<|image_pad|>"]
    assert thinker.audio_token_id == vocab["<|audio_pad|>"]
    assert thinker.video_token_id == vocab["<|video_pad|>"]
    assert thinker.vision_start_token_id == vocab["<|vision_start|>"]
    assert thinker.audio_start_token_id == vocab["<|audio_start|>"]
    assert (config.im_start_token_id, config.im_end_token_id) == (vocab["<|im_start|>"], vocab["<|im_end|>"])
    assert (config.user_token_id, config.assistant_token_id) == (vocab["user"], vocab["assistant"])
    assert config.tts_pad_token_id == vocab["<tts_pad>"]
    assert thinker.text_config.vocab_size == len(vocab)
    text = thinker.text_config
    assert text.num_key_value_heads < text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2


def test_demo_chat_template_renders_system_turns_media_and_generation_prompt(demo_model: LoadedModel) -> None:
    messages = [
        SYSTEM,
        _user({"type": "image"}, _text("What is this?")),
        {"role": "assistant", "content": [_text("A red house.")]},
        _user({"type": "audio"}, _text("And this?")),
    ]
    text = demo_model.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA red house.<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>And this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_demo_chat_template_accepts_plain_string_contents(demo_model: LoadedModel) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = demo_model.processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_processor_expands_one_second_of_audio_to_13_tokens(demo_model: LoadedModel) -> None:
    inputs = _inputs(demo_model, [_user({"type": "audio"}, _text("Hi"))], audio=[_audio(1.0)])
    audio_id = demo_model.model.config.thinker_config.audio_token_id
    assert int((inputs["input_ids"] == audio_id).sum()) == 13
    assert tuple(inputs["input_features"].shape) == (1, 128, 100)
    assert int(inputs["feature_attention_mask"].sum()) == 100


def test_processor_turns_a_1024x768_image_into_at_most_768_tokens(demo_model: LoadedModel) -> None:
    inputs = _inputs(demo_model, [_user({"type": "image"})], images=[_image(1024, 768)])
    image_id = demo_model.model.config.thinker_config.image_token_id
    assert int((inputs["input_ids"] == image_id).sum()) <= 768
    assert int(inputs["image_grid_thw"].prod()) // 4 == int((inputs["input_ids"] == image_id).sum())


def test_the_processor_for_a_machine_without_torchvision_refuses_video_and_reads_the_rest(
    demo_checkpoint: Path,
) -> None:
    # What `load_processor` loads where torchvision is missing (the GPU machine's image, say).
    processor = ProcessorWithoutVideo.from_pretrained(demo_checkpoint)
    assert not video_supported(processor)
    video = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(MediaError, match="torchvision"):
        processor(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[video])
    inputs = processor(text="<|vision_start|><|image_pad|><|vision_end|>", images=[_image()], return_tensors="pt")
    assert inputs["image_grid_thw"].shape == (1, 3)


# Loading


def test_demo_loads_as_float32_on_the_cpu_with_its_checkpoint_path(
    demo_model: LoadedModel, demo_checkpoint: Path
) -> None:
    assert demo_model.path == demo_checkpoint.resolve()
    assert demo_model.device == torch.device("cpu")
    assert demo_model.dtype == torch.float32
    assert next(demo_model.model.parameters()).dtype == torch.float32
    assert not demo_model.model.training


def test_a_checkpoint_directory_loads_like_the_demo(demo_settings: Settings, demo_checkpoint: Path) -> None:
    loaded = load_model(demo_settings.replace(model=str(demo_checkpoint)))
    assert loaded.path == demo_checkpoint.resolve()
    inputs = _inputs(loaded, [_user(_text("Hello"))])
    assert len(_greedy_reply(loaded, inputs, 4)) > 0


def test_a_checkpoint_in_the_hub_layout_loads(demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path) -> None:
    # The real checkpoint keeps image and audio settings in one preprocessor_config.json and the
    # template in chat_template.json.
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "hub")
    processor_config = json.loads((path / "processor_config.json").read_text())
    merged = {**processor_config["feature_extractor"], **processor_config["image_processor"]}
    (path / "preprocessor_config.json").write_text(json.dumps(merged), encoding="utf-8")
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    (path / "processor_config.json").unlink()
    (path / "chat_template.jinja").unlink()
    loaded = load_model(demo_settings.replace(model=str(path)))
    assert loaded.processor.image_processor.patch_size == 16
    assert loaded.processor.feature_extractor.feature_size == 128
    assert loaded.processor.chat_template == template


def test_a_sharded_checkpoint_loads(demo_settings: Settings, demo_model: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    demo_model.model.save_pretrained(path, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        shutil.copy(demo_model.path / name, path / name)
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(demo_settings.replace(model=str(path)))
    inputs = _inputs(loaded, [_user(_text("Hello"))])
    assert _greedy_reply(loaded, inputs) == _greedy_reply(demo_model, inputs)


def test_speech_off_loads_no_talker_and_no_code2wav(demo_model: LoadedModel, demo_settings: Settings) -> None:
    model = demo_model.model
    assert not demo_model.speech
    assert not hasattr(model, "talker") and not hasattr(model, "code2wav")
    with_speech = load_model(_speech_settings(demo_settings))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    talker_and_code2wav = count(with_speech.model.talker) + count(with_speech.model.code2wav)
    assert count(model) == count(model.thinker)
    assert count(with_speech.model) - count(model) == talker_and_code2wav > 0


def test_speech_on_checkpoint_without_a_talker_is_refused(
    demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path
) -> None:
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "thinking")
    config = json.loads((path / "config.json").read_text())
    config["enable_audio_output"] = False
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(CheckpointError, match="no Talker"):
        load_model(_speech_settings(demo_settings).replace(model=str(path)))


def test_thinker_eos_token_ids_are_end_of_turn_then_end_of_text(demo_model: LoadedModel) -> None:
    vocab = demo_model.processor.tokenizer.get_vocab()
    assert thinker_eos_token_ids(demo_model) == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    assert demo_model.model.thinker.generation_config.eos_token_id == thinker_eos_token_ids(demo_model)


# Generation


def test_thinker_generates_greedily_from_a_text_prompt(demo_model: LoadedModel) -> None:
    inputs = _inputs(demo_model, [SYSTEM, _user(_text("Tell me a story about a cat."))])
    reply = _greedy_reply(demo_model, inputs)
    assert 0 < len(reply) <= 8
    assert reply == _greedy_reply(demo_model, inputs)


def test_thinker_generates_greedily_from_an_image_prompt(demo_model: LoadedModel) -> None:
    inputs = _inputs(demo_model, [_user({"type": "image"}, _text("What is this?"))], images=[_image()])
    assert "pixel_values" in inputs and "image_grid_thw" in inputs
    assert len(_greedy_reply(demo_model, inputs)) > 0


def test_thinker_generates_greedily_from_an_audio_prompt(demo_model: LoadedModel) -> None:
    inputs = _inputs(demo_model, [_user({"type": "audio"}, _text("What is this?"))], audio=[_audio()])
    assert "input_features" in inputs and "feature_attention_mask" in inputs
    assert len(_greedy_reply(demo_model, inputs)) > 0


def test_greedy_replies_vary_with_the_prompt(demo_model: LoadedModel) -> None:
    prompts = ["Hello there!", "Tell me a story about a cat.", "How is the weather today?", "1, 2, 3"]
    replies = [tuple(_greedy_reply(demo_model, _inputs(demo_model, [_user(_text(p))]))) for p in prompts]
    assert len(set(replies)) == len(replies)
    assert len({token for reply in replies for token in reply}) > 8


def test_greedy_replies_depend_on_the_sound_and_the_picture(demo_model: LoadedModel) -> None:
    question = _text("What is this?")
    sounds = [_inputs(demo_model, [_user({"type": "audio"}, question)], audio=[_audio(1.0, f)]) for f in (220, 880)]
    pictures = [_inputs(demo_model, [_user({"type": "image"}, question)], images=[_image(seed=s)]) for s in (0, 2)]
    for first, second in (sounds, pictures):
        assert _greedy_reply(demo_model, first) != _greedy_reply(demo_model, second)


def test_speech_on_model_speaks_about_an_image_and_a_sound(demo_settings: Settings) -> None:
    loaded = load_model(_speech_settings(demo_settings))
    assert loaded.speech
    messages = [_user({"type": "image"}, {"type": "audio"}, _text("What do you see and hear?"))]
    inputs = _inputs(loaded, messages, images=[_image()], audio=[_audio()])
    torch.manual_seed(0)
    with torch.no_grad():
        sequences, waveform = loaded.model.generate(
            **inputs,
            thinker_max_new_tokens=6,
            thinker_eos_token_id=thinker_eos_token_ids(loaded),
            talker_max_new_tokens=8,
        )
    assert sequences.shape[1] > inputs["input_ids"].shape[1]
    assert waveform.ndim == 3 and waveform.shape[-1] > 0
    assert torch.isfinite(waveform).all()


@pytest.mark.parametrize("part", ["thinker", "talker"], ids=["thinker ends at once", "talker ends at once"])
def test_speech_survives_a_part_that_ends_at_once(part: str, demo_settings: Settings) -> None:
    loaded = load_model(_speech_settings(demo_settings))
    model = loaded.model
    if part == "thinker":
        head, end = model.thinker.lm_head, thinker_eos_token_ids(loaded)[0]
    else:
        head, end = model.talker.codec_head, model.config.talker_config.codec_eos_token_id

    def always_end(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, torch.tensor([end]), 100.0)

    head.register_forward_hook(always_end)
    inputs = _inputs(loaded, [_user(_text("Hi"))])
    with torch.no_grad():
        _, waveform = model.generate(
            **inputs,
            thinker_max_new_tokens=4,
            thinker_eos_token_id=thinker_eos_token_ids(loaded),
            talker_max_new_tokens=8,
        )
    assert waveform.shape[-1] > 0


# Incomplete checkpoints


def _remove(*names: str):
    def edit(path: Path) -> None:
        for name in names:
            (path / name).unlink()

    return edit


def _shard_index_naming_a_missing_shard(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")


INCOMPLETE = {
    "config": (_remove("config.json"), "config.json"),
    "weights": (_remove("model.safetensors"), "weights (model.safetensors"),
    "shard": (_shard_index_naming_a_missing_shard, "weight shard model-00002-of-00002.safetensors"),
    "tokenizer_config": (_remove("tokenizer_config.json"), "tokenizer_config.json"),
    "vocabulary": (_remove("tokenizer.json"), "tokenizer vocabulary"),
    "processor_config": (_remove("processor_config.json"), "processor settings"),
    "chat_template": (_remove("chat_template.jinja"), "chat template"),
}


@pytest.mark.parametrize("what", INCOMPLETE, ids=[f"missing {w} is named" for w in INCOMPLETE])
def test_incomplete_checkpoint_is_refused_naming_what_is_missing_and_where(
    what: str, demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path
) -> None:
    edit, expected = INCOMPLETE[what]
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "broken")
    edit(path)
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path)))
    message = str(raised.value)
    assert expected in message and str(path.resolve()) in message


def test_missing_checkpoint_directory_is_refused(demo_settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(demo_settings.replace(model=str(tmp_path / "nowhere")))


def test_a_checkpoint_of_another_model_is_refused(
    demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path
) -> None:
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "other")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    with pytest.raises(CheckpointError, match="llama"):
        load_model(demo_settings.replace(model=str(path)))


def test_a_checkpoint_lacking_a_weight_is_refused_naming_it(
    demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path
) -> None:
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "partial")
    weights = load_file(path / "model.safetensors")
    name = "thinker.lm_head.weight"
    del weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_model(demo_settings.replace(model=str(path)))


def test_unreadable_weights_are_refused(demo_settings: Settings, demo_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy_checkpoint(demo_checkpoint, tmp_path / "corrupt")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="could not load the weights"):
        load_model(demo_settings.replace(model=str(path)))


# Device and dtype


def test_auto_dtype_is_float32_on_the_cpu_and_bfloat16_on_a_gpu() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_unknown_device_name_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="device"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_device_without_a_gpu_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="no CUDA GPU"):
        resolve_device("cuda")
