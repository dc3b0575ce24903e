"""Every workaround for a transformers (5.24) Qwen3-Omni bug or gap, each with its reason.

The loader calls `load_processor` for the processor and `apply_workarounds` once on each loaded
model; the demo builder calls `init_talker_experts` on the random weights it makes; the `torch` MoE
backend (engine/forward/moe/) calls each router by `router_past_hooks`, and its experts are captured in CUDA
graphs inside `capturable_experts`. Nothing else in omni_local works around transformers.
"""

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
)
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

from omni_local.errors import MediaError

NO_TORCHVISION = "video input needs torchvision, which is not installed here"


def load_processor(path: Path) -> Qwen3OmniMoeProcessor:
    # `Qwen3OmniMoeProcessor.from_pretrained` always builds a video processor, and fails where it
    # cannot: transformers' video processors need torchvision, which has no build for the CPU torch we
    # run on; a copy saved where torchvision was missing records a placeholder in its place (a
    # stand-in's `to_dict` is only `{"video_processor_type": "<its class>"}`: a class transformers
    # cannot resolve, or a bare `VideoProcessorMixin` that reads no frame), or none at all. Then we
    # load a subclass that takes a stand-in for the video processor: text, images and audio work
    # exactly as with the real one (same components, same files); a video is refused, saying why.
    # The real processor is tried first, so where it loads its video processor is built once.
    if is_torchvision_available():
        try:
            processor = Qwen3OmniMoeProcessor.from_pretrained(path)
        except (OSError, ValueError):  # no video processor it can build (or another file is bad: see below)
            processor = None
        if processor is not None and isinstance(processor.video_processor, BaseVideoProcessor):
            return processor
    # A file that is bad for every component fails again here, and the loader names it.
    refusal = NO_TORCHVISION if not is_torchvision_available() else _video_processor_refusal(path)
    processor = ProcessorWithoutVideo.from_pretrained(path)
    processor.video_processor = _NoVideoProcessor(refusal)
    return processor


def video_supported(processor: Qwen3OmniMoeProcessor) -> bool:
    """Whether `processor` has a real video processor (torchvision is installed, and the checkpoint
    records one)."""
    return not isinstance(processor.video_processor, _NoVideoProcessor)


def video_refusal(processor: Qwen3OmniMoeProcessor) -> str:
    """Why `processor` refuses every video (only asked where `video_supported` is false)."""
    return processor.video_processor.refusal


def _video_processor_refusal(path: Path) -> str:
    """Why the video processor recorded in `path` cannot read video (asked once the processor failed
    to build a real one)."""
    try:
        recorded, _ = BaseVideoProcessor.get_video_processor_dict(path)
    except OSError:
        return f"video input is not available: checkpoint '{path.name}' records no video processor"
    # The older layout records none of its own: transformers infers it from the image processor's.
    name = recorded.get("video_processor_type") or recorded.get("image_processor_type")
    return (f"video input is not available: checkpoint '{path.name}' records a placeholder video processor "
            f"({name}), as a copy saved without torchvision does")


def apply_workarounds(model: Qwen3OmniMoeForConditionalGeneration, end_of_turn_ids: list[int], pad_id: int) -> None:
    _set_thinker_generation_ids(model, end_of_turn_ids, pad_id)
    if getattr(model, "has_talker", False):
        _give_talker_the_audio_window(model)
        _guard_spoken_generate(model)


def _set_thinker_generation_ids(
    model: Qwen3OmniMoeForConditionalGeneration, end_of_turn_ids: list[int], pad_id: int
) -> None:
    # `model.thinker` is built from its sub-config, so `thinker.generate` ignores the checkpoint's
    # generation_config.json: without this it never stops at <|im_end|> and warns about padding.
    model.thinker.generation_config.eos_token_id = list(end_of_turn_ids)
    model.thinker.generation_config.pad_token_id = pad_id


def _give_talker_the_audio_window(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    # The Talker's position code (the Thinker's `get_rope_index`, shared) reads
    # `config.audio_config.n_window` when a prompt holds audio and an image or video, but the
    # Talker config has no `audio_config`: such a spoken reply fails with AttributeError. The
    # window belongs to the audio encoder, so the Talker gets the Thinker's audio config.
    talker_config = model.talker.config
    if getattr(talker_config, "audio_config", None) is None:
        talker_config.audio_config = model.config.thinker_config.audio_config


def _guard_spoken_generate(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    # Two crashes of `generate(return_audio=True)` when a part of the reply is empty, turned into a
    # reply by defaults the caller can still override:
    # - the Talker's prompt needs the hidden state of the first reply token, which only exists once
    #   a second token is generated; a Thinker that ends at once fails with a size mismatch in
    #   `_get_talker_assistant_parts`, so the Thinker must write two tokens;
    # - the Talker's codes are stacked, and a Talker whose first code is codec EOS fails on an empty
    #   stack, so it must emit one code (under 80 ms of audio).
    generate = model.generate

    @functools.wraps(generate)
    def generate_with_guards(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("thinker_min_new_tokens", 2)
        kwargs.setdefault("talker_min_new_tokens", 1)
        return generate(*args, **kwargs)

    model.generate = generate_with_guards


def init_talker_experts(model: Qwen3OmniMoeForConditionalGeneration, std: float) -> None:
    # `_init_weights` initialises the Thinker's MoE experts and routers but not the Talker's
    # (`Qwen3OmniMoeTalkerTextExperts` is `torch.empty`, its router `torch.zeros`), so a model built
    # from a config, not loaded, has uninitialised memory there (weights that differ run to run and
    # can be NaN), and a router that ties every expert, so which experts run is topk's tie-break.
    with torch.no_grad():
        for layer in model.talker.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                torch.nn.init.normal_(experts.gate_up_proj, std=std)
                torch.nn.init.normal_(experts.down_proj, std=std)
                torch.nn.init.normal_(layer.mlp.gate.weight, std=std)


def router_past_hooks(router: torch.nn.Module, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`router(flat)`: (logits, top-k weights, top-k experts), called by `forward`, past its hooks."""
    # Once transformers has run a model, its routers carry a hook that records their logits when
    # asked to (`output_router_logits`), and the hook reads a ContextVar, which dynamo (torch 2.11)
    # cannot trace: the compiled decoder layers failed on the Talker after a spoken `generate`.
    return router.forward(flat)


@contextmanager
def capturable_experts(config: Any, dtype: torch.dtype) -> Iterator[None]:
    """MoE experts that a CUDA graph can capture, for what runs inside; `config` is the decoder stack's."""
    # transformers' default experts kernel, `grouped_mm`, runs bfloat16 on CUDA in one kernel, but
    # other dtypes through torch's fallback, which copies the group offsets to the host: capture
    # refuses that (float32, torch 2.11, H200). `batched_mm` gathers each chosen expert's weights
    # instead, with no host copy; eager forwards outside keep `grouped_mm`.
    saved = config._experts_implementation
    if dtype != torch.bfloat16 and saved == "grouped_mm":
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        config._experts_implementation = saved


class _NoVideoProcessor(VideoProcessorMixin):
    """Stands in for the video processor where there is none to load: refuses every video, saying why."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, refusal: str = NO_TORCHVISION) -> None:
        super().__init__()
        self.refusal = refusal

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise MediaError(self.refusal)


class ProcessorWithoutVideo(Qwen3OmniMoeProcessor):
    """Qwen3-Omni's processor with `_NoVideoProcessor` in the video slot (see `load_processor`)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: object) -> type:
        # transformers' own check looks the video class up in a registry that is a placeholder
        # without torchvision, and crashes on it.
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)

    @classmethod
    def _get_arguments_from_pretrained(
        cls, pretrained_model_name_or_path: str | Path, processor_dict: dict | None = None, **kwargs: Any
    ) -> list[Any]:
        # The same components `from_pretrained` loads, in `get_attributes()` order, but the video one.
        path = pretrained_model_name_or_path
        kwargs.pop("subfolder", None)
        return [
            AutoImageProcessor.from_pretrained(path, **kwargs),
            _NoVideoProcessor(),
            AutoFeatureExtractor.from_pretrained(path, **kwargs),
            AutoTokenizer.from_pretrained(path, **kwargs),
        ]
