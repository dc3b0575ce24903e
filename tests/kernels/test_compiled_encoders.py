"""The encoders give what transformers' own give, and compiled, one graph each serves every image
size and clip length: after warm-up no size recompiles them."""

import numpy as np
import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

from omni_local.engine.forward.encoders import Encoders, audio_forward, audio_stack
from device_under_test import TEST_DEVICE

IMAGE_SIZES = [(224, 224), (333, 517), (480, 640), (640, 480), (1024, 768)]  # (width, height)
CLIP_SECONDS = [1.0, 3.0, 7.5, 30.0]
# float32 on the CPU: inductor fuses and reorders sums, so compiled outputs differ from eager in
# the last bits (measured: at most 1.4e-5 absolute, on outputs of magnitude up to 30).
TOLERANCE = dict(rtol=1e-4, atol=1e-4)

# Inductor's CPU backend imports a TorchScript module of torch's own, which warns on import.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def compiled_graphs() -> int:
    # Dynamo counts every graph it compiles, a recompile of a known function included.
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def thinker_model(demo_model):
    return demo_model.model.thinker.model


@pytest.fixture(scope="module")
def processor(demo_model):
    return demo_model.processor


@pytest.fixture(scope="module")
def eager(thinker_model) -> Encoders:
    return Encoders(thinker_model, compile=False)


@pytest.fixture(scope="module")
def compiled(thinker_model, processor) -> Encoders:
    encoders = Encoders(thinker_model, compile=True)
    before = compiled_graphs()
    encoders.warm_up(processor)
    # One graph per encoder (none if this session compiled them already).
    assert compiled_graphs() - before <= 2
    return encoders


def image_inputs(processor, *sizes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(sum(w * h for w, h in sizes))
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    encoded = processor.image_processor(images=images, return_tensors="pt")
    return encoded["pixel_values"].to(TEST_DEVICE), encoded["image_grid_thw"].to(TEST_DEVICE)


def audio_inputs(processor, *seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(len(seconds))
    clips = [(0.1 * rng.standard_normal(int(s * 16_000))).astype(np.float32) for s in seconds]
    encoded = processor.feature_extractor(
        clips, sampling_rate=16_000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
    )
    return encoded["input_features"].to(TEST_DEVICE), encoded["attention_mask"].to(TEST_DEVICE)


IMAGE_BATCHES = [[size] for size in IMAGE_SIZES] + [IMAGE_SIZES[:3]]
CLIP_BATCHES = [[seconds] for seconds in CLIP_SECONDS] + [CLIP_SECONDS]


@pytest.mark.parametrize("sizes", IMAGE_BATCHES, ids=str)
def test_eager_images_are_bit_identical_to_transformers(eager, thinker_model, processor, sizes):
    pixels, grid = image_inputs(processor, *sizes)
    with torch.inference_mode():
        reference = thinker_model.get_image_features(pixels, grid)
    merged, deepstack = eager.images(pixels, grid)
    assert torch.equal(merged, torch.cat(reference.pooler_output))
    assert len(deepstack) == len(reference.deepstack_features)
    for ours, theirs in zip(deepstack, reference.deepstack_features):
        assert torch.equal(ours, torch.cat(theirs))


@pytest.mark.parametrize("seconds", CLIP_BATCHES, ids=str)
def test_eager_audio_is_bit_identical_to_transformers(eager, thinker_model, processor, seconds):
    features, mask = audio_inputs(processor, *seconds)
    with torch.inference_mode():
        reference = thinker_model.get_audio_features(features, mask).last_hidden_state
    assert torch.equal(eager.audio(features, mask), reference)


def test_compiled_images_match_eager_and_no_size_recompiles(compiled, eager, processor):
    before = compiled_graphs()
    for sizes in IMAGE_BATCHES:
        assert_vision_matches(compiled, eager, *image_inputs(processor, *sizes))
    assert compiled_graphs() == before


def assert_vision_matches(compiled: Encoders, eager: Encoders, pixels: torch.Tensor, grid: torch.Tensor) -> None:
    merged, deepstack = compiled.images(pixels, grid)
    expected_merged, expected_deepstack = eager.images(pixels, grid)
    torch.testing.assert_close(merged, expected_merged, **TOLERANCE)
    for ours, expected in zip(deepstack, expected_deepstack, strict=True):
        torch.testing.assert_close(ours, expected, **TOLERANCE)


def test_compiled_audio_matches_eager_and_no_length_recompiles(compiled, eager, processor):
    before = compiled_graphs()
    # 50 ms is a single audio token, a size dynamo would otherwise give a graph of its own.
    for seconds in [*CLIP_BATCHES, [0.05]]:
        features, mask = audio_inputs(processor, *seconds)
        torch.testing.assert_close(compiled.audio(features, mask), eager.audio(features, mask), **TOLERANCE)
    assert compiled_graphs() == before


def test_the_graph_count_sees_each_recompile_of_a_stack_without_dynamic_sizes(compiled, thinker_model, processor):
    # The control for the tests above: the same audio layer stack, compiled with static sizes, is
    # compiled again for each new clip length, and the count shows it.
    static = torch.compile(lambda tower, hidden, cu_seqlens: audio_stack(tower, hidden, cu_seqlens), dynamic=False)
    before = compiled_graphs()
    with torch.inference_mode():
        for seconds in (1.0, 3.0, 3.0):
            audio_forward(thinker_model.audio_tower, *audio_inputs(processor, seconds), stack=static)
    assert compiled_graphs() - before == 2


def video_inputs(processor, *seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames at 2 a second (at least 4), as videos are read, through the video processor."""
    rng = np.random.default_rng(len(seconds))
    clips = [rng.integers(0, 256, (max(4, round(2 * s)), 96, 128, 3), dtype=np.uint8) for s in seconds]
    encoded = processor.video_processor(videos=clips, do_sample_frames=False, return_tensors="pt")
    return encoded["pixel_values_videos"].to(TEST_DEVICE), encoded["video_grid_thw"].to(TEST_DEVICE)


@pytest.mark.torchvision
def test_eager_videos_are_bit_identical_to_transformers(eager, thinker_model, processor):
    pixels, grid = video_inputs(processor, 2.0)
    merged, deepstack = eager.images(pixels, grid)
    with torch.inference_mode():
        expected = thinker_model.get_video_features(pixels, grid, return_dict=True)
    assert torch.equal(merged, torch.cat(expected.pooler_output))
    for ours, theirs in zip(deepstack, expected.deepstack_features, strict=True):
        assert torch.equal(ours, torch.cat(theirs))  # each level: one tensor per video


@pytest.mark.torchvision
def test_compiled_videos_match_eager_and_no_frame_count_recompiles(compiled, eager, processor):
    # Attention runs per frame (a segment each), so more frames are only more segments and tokens.
    before = compiled_graphs()
    for seconds in ([1.0], [2.0], [4.0], [1.0, 4.0]):
        assert_vision_matches(compiled, eager, *video_inputs(processor, *seconds))
    assert compiled_graphs() == before
