"""Images and videos to encode are preprocessed on the model's device: their frames go there as
uint8, the processor resizes and normalises them there, and the encoders get pixels already there.
On the CPU, the device argument gives the plain processor call's pixels bit for bit (the same code
path runs on CUDA, where a resize may round otherwise: see `preprocess`)."""

import numpy as np
import pytest
import torch

from samples import picture
from omni_local.engine.prompt.encoder_inputs import image_inputs, video_inputs
from omni_local.media.video import Video

CPU = torch.device("cpu")


def frames(seed: int, shape: tuple[int, int, int] = (20, 360, 640)) -> np.ndarray:
    """A 10 s clip at 2 frames a second, as the benchmark's (count, height, width, RGB)."""
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


@pytest.mark.parametrize("size", [(1600, 1200), (160, 120)], ids=["1200x1600", "120x160"])
def test_an_image_preprocessed_with_the_device_argument_on_the_cpu_is_the_plain_call_bit_for_bit(demo_model, size):
    processor = demo_model.processor
    images = [picture(1, size), picture(2, (224, 224))]
    plain = processor.image_processor(images=images, return_tensors="pt")
    on_cpu = image_inputs(images, processor, CPU)
    assert on_cpu["pixel_values"].dtype == plain["pixel_values"].dtype == torch.float32
    assert torch.equal(on_cpu["pixel_values"], plain["pixel_values"])
    assert torch.equal(on_cpu["image_grid_thw"], plain["image_grid_thw"])


@pytest.mark.torchvision
def test_a_video_preprocessed_with_the_device_argument_on_the_cpu_is_the_plain_call_bit_for_bit(demo_model):
    processor = demo_model.processor
    videos = [Video(frames(3), 2.0, None), Video(frames(4, (4, 64, 96)), 2.0, None)]
    plain = processor.video_processor(videos=[v.frames for v in videos], do_sample_frames=False, return_tensors="pt")
    on_cpu = video_inputs(videos, processor, CPU)
    assert torch.equal(on_cpu["pixel_values_videos"], plain["pixel_values_videos"])
    assert torch.equal(on_cpu["video_grid_thw"], plain["video_grid_thw"])


def test_the_engine_resizes_an_image_as_uint8_on_the_models_device_and_encodes_pixels_already_there(
    app, monkeypatch
):
    processor = app.backend.loaded.processor.image_processor
    device = app.backend.engine.runner.encoder.device
    encoders = app.backend.engine.runner.encoder.encoders
    resized, encoded = [], []
    resize, images = processor.resize, encoders.images

    def resizing(*args, **kwargs):
        resized.append((kwargs["images"].dtype, kwargs["images"].device))
        return resize(*args, **kwargs)

    def encoding(pixel_values, image_grid_thw):
        encoded.append(pixel_values.device)
        return images(pixel_values, image_grid_thw)

    monkeypatch.setattr(processor, "resize", resizing)
    monkeypatch.setattr(encoders, "images", encoding)
    # A picture no earlier test sent, so the encoder cache cannot answer it.
    app.session().send("What is this?", images=[picture(4021, (333, 517))], max_new_tokens=1).result()
    assert resized == [(torch.uint8, device)]
    assert encoded == [device]
