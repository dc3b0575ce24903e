"""Qwen3-Omni at its real dimensions with random weights: how full-size speed is measured here.

No real checkpoint can be downloaded on our machines, and timings do not depend on weight values.
The token ids of the config are mapped onto the demo model's tokenizer, so the demo's processor
(same patch, merge and mel settings as the real one) builds the prompts. With quantized `weights`
the model is built in full precision on the device, then quantized layer by layer: a card smaller
than the full-precision model cannot build it this way (the loader from a checkpoint quantizes each
tensor as it reads it). Experts that `experts_on_gpu` = N puts in host memory move there last.
"""

import json
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omni_local.model.demo import VISION_END, ensure_demo_checkpoint, media_token_ids
from omni_local.model.host_experts import AUTO, move_to_host_memory
from omni_local.model.loader import LoadedModel, end_of_turn_ids, resolve_device, resolve_dtype
from omni_local.model.quantized import quantize_layers
from omni_local.model.workarounds import apply_workarounds, init_talker_experts, load_processor
from omni_local.settings import Settings


def load_random_weights(config_path: Path, settings: Settings) -> LoadedModel:
    demo = ensure_demo_checkpoint(settings.demo_path)
    processor = load_processor(demo)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    config = full_size_config(config_path, processor.tokenizer, settings.speech)
    with torch.device(device):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation=settings.attn_implementation
        )
    if settings.speech:
        init_talker_experts(model, config.initializer_range)
    apply_workarounds(model, end_of_turn_ids(processor), processor.tokenizer.pad_token_id)
    quantize_layers(model, settings.weights)  # one layer at a time: the full-precision layer is freed as it goes
    if settings.experts_on_gpu != AUTO:
        move_to_host_memory(model, settings.experts_on_gpu, embeddings=False)  # a layer at a time too
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the freed full-precision layers back, for a cap on the process to measure
    return LoadedModel(model=model.eval(), processor=processor, path=Path(config_path), device=device, dtype=dtype)


def full_size_config(config_path: Path, tokenizer, speech: bool) -> Qwen3OmniMoeConfig:
    """The config at `config_path`, its token ids those of the demo's `tokenizer`."""
    config = Qwen3OmniMoeConfig(**_remapped(json.loads(Path(config_path).read_text()), tokenizer))
    config.enable_audio_output = speech
    return config


def _remapped(config: dict, tokenizer) -> dict:
    ids = {**media_token_ids(tokenizer), "vision_end_token_id": tokenizer.convert_tokens_to_ids(VISION_END)}
    thinker = {**config["thinker_config"], **ids}
    talker = {**config["talker_config"], **{k: v for k, v in ids.items() if k in config["talker_config"]}}
    # The tokens the Talker's prompt is cut and built by (turn starts, roles, its text specials).
    top = {field: tokenizer.convert_tokens_to_ids(token) for field, token in _TOP_LEVEL_TOKENS.items()}
    return {**config, **top, "thinker_config": thinker, "talker_config": talker}


_TOP_LEVEL_TOKENS = {
    "im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "system_token_id": "system",
    "user_token_id": "user", "assistant_token_id": "assistant", "tts_pad_token_id": "<tts_pad>",
    "tts_bos_token_id": "<tts_text_bos>", "tts_eos_token_id": "<tts_text_eod>",
}
