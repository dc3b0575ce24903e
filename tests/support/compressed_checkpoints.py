"""The demo checkpoint quantized as the community's 4-bit and FP8 Qwen3-Omni checkpoints are: by
compressed-tensors 0.20's own code, offline, the way llm-compressor drives it.

The model is loaded from the demo, each layer of routed experts is split into per-expert Linear
layers (as they were in the transformers that those checkpoints were made with, and as the files
name them), compressed-tensors' `apply_quantization_config` marks the layers a config targets, each
one's scales are computed by `calculate_qparams` from its weight's minimum and maximum (a min-max
observer, no calibration data), `ModelCompressor` packs the weights and writes the config into
config.json. The tensors are saved under the checkpoint's names, in one file or spread over
`shards` files round robin (so a layer's stored tensors lie in different files).
"""

import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import Qwen3OmniMoeForConditionalGeneration

GROUP_SIZE = 32  # divides the demo's inputs: hidden 64, expert intermediate 32, attention 128
# As the community's configs: every Linear, but the output heads, the MoE routers and the Talker's
# shared-expert gate, the vision and audio towers, and Code2Wav.
IGNORE = ["re:.*lm_head", "re:.*codec_head$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*visual\\..*",
          "re:.*audio_tower\\..*", "re:code2wav\\..*"]
SCHEMES = {
    "W4A16": lambda: QuantizationScheme(
        targets=["Linear"], format="pack-quantized",
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE)),
    "FP8": lambda: preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).model_copy(update={"format": "float-quantized"}),
}
_WEIGHTS = "model.safetensors"
# transformers 5's names back to the checkpoint's (checkpoint_names.py's renames, undone)
_CHECKPOINT_PREFIXES = (("thinker.model.language_model.", "thinker.model."),
                        ("thinker.model.visual.", "thinker.visual."),
                        ("thinker.model.audio_tower.", "thinker.audio_tower."))


class _Expert(torch.nn.Module):
    """One routed expert as three Linear layers, as transformers 4 held it."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            setattr(self, name, layer)


def write_compressed(demo: Path, target: Path, scheme: str, shards: int = 1) -> Path:
    """The demo in compressed-tensors' `scheme` ("W4A16", "FP8") at `target`."""
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(demo, dtype=torch.float32)
    _split_experts(model)
    config = QuantizationConfig(config_groups={"group_0": SCHEMES[scheme]()}, ignore=IGNORE,
                                format=SCHEMES[scheme]().format, quantization_status="frozen")
    apply_quantization_config(model, config, show_progress=False)
    _observe_min_max(model)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)

    in_demo = load_file(demo / _WEIGHTS).keys()
    tensors = {}
    for name, tensor in model.state_dict().items():
        name = checkpoint_name(name)
        if name in in_demo or name.rpartition(".")[2].startswith("weight_"):
            tensors[name] = tensor.detach().contiguous()
    shutil.copytree(demo, target, ignore=shutil.ignore_patterns(_WEIGHTS))
    _save(tensors, target, shards)
    compressor.update_config(str(target))
    return target


def write_quantization_config(path: Path, config: QuantizationConfig) -> None:
    """Replace `path`'s quantization_config with `config`, as compressed-tensors writes one."""
    ModelCompressor(quantization_config=config).update_config(str(path))


def checkpoint_name(name: str) -> str:
    for model_prefix, checkpoint_prefix in _CHECKPOINT_PREFIXES:
        if name.startswith(model_prefix):
            return checkpoint_prefix + name.removeprefix(model_prefix)
    return name


def _split_experts(model: torch.nn.Module) -> None:
    for name, module in list(model.named_modules()):
        if name.endswith(".mlp.experts"):
            experts = torch.nn.ModuleList()
            for gate_up, down in zip(module.gate_up_proj.detach(), module.down_proj.detach()):
                experts.append(_Expert(*gate_up.chunk(2), down))
            model.set_submodule(name, experts)


def _observe_min_max(model: torch.nn.Module) -> None:
    """Each quantized layer's scales (and zero points) from its weight's range, per group or row."""
    for module in model.modules():
        args = getattr(module, "quantization_scheme", None) and module.quantization_scheme.weights
        if args is None:
            continue
        weight = module.weight.detach()
        if args.strategy == "group":
            weight = weight.unflatten(-1, (-1, args.group_size))
            low, high = weight.amin(-1), weight.amax(-1)
        else:
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero_point)


def _save(tensors: dict[str, torch.Tensor], target: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, target / _WEIGHTS, metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for number in range(shards):
        shard = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        chosen = names[number::shards]  # neighbours (a layer's packed values, scales, shape) apart
        save_file({name: tensors[name] for name in chosen}, target / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chosen, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
