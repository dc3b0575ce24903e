"""The demo checkpoint GPTQ-packed as AutoRound exports the community's calibrated 4-bit Qwen3-Omni
checkpoints, and its oracle: the same checkpoint with those layers' dequantized weights in float32.

Packed, as AutoRound's recipe for Qwen3-Omni packs (its `_get_qwen3_omni_moe_multimodal_block`:
the Thinker's decoder layers only): each attention projection and routed expert of the Thinker's
layers, symmetric int4 in groups of GROUP_SIZE; the MoE routers (`mlp.gate`, which AutoRound keeps
in 16 bits), the Talker, the towers and the heads stay as the demo holds them.

No GPTQ package installs here as a test dependency (auto-round pulls datasets and pyarrow; GPTQModel
and AutoGPTQ build CUDA extensions), so this follows AutoRound 0.16.1's own code: its symmetric
rounding with no tuning (`auto_round/data_type/int.py`, `quant_tensor_sym`: a group's largest
magnitude maps to -8, the scale in float16) and its packing (`auto_round_extension/torch/
qlinear_torch_zp.py`, `QuantLinear.pack_248_bits`, which its GPTQ export and its
`auto_round:auto_gptq` format both use). On 2026-12-06, with auto-round 0.16.1 run once outside the
suite, `symmetric_int4` gave `quant_tensor_sym`'s scales and dequantized weights, and `pack` its
QuantLinear's qweight, qzeros, scales and g_idx, bit for bit, for every packed layer of the demo.

Two configs, as AutoRound writes each (auto_round/export/): "gptq" (`save_quantized_as_autogptq`:
quant_method "gptq", desc_act false, g_idx stored, each router named in `dynamic` as not
quantized) and "auto-round" (`save_quantized_as_autoround`: packing_format
"auto_round:auto_gptq", no g_idx, each router in `extra_config` with bits 16).
"""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP_SIZE = 32  # divides the demo's inputs: hidden 64, expert intermediate 32, attention 128
FLAVOURS = ("gptq", "auto-round")
_WEIGHTS = "model.safetensors"
_PACKED = re.compile(r"^thinker\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
                     r"\.weight$")
_ROUTER = re.compile(r"^thinker\.model\.layers\.\d+\.mlp\.gate\.weight$")
_ZERO_V1 = 0x77777777  # eight nibbles of the symmetric zero 8, stored minus 1 (GPTQ's v1 format)


def symmetric_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoRound's `quant_tensor_sym` with no tuning: q [N, K] in [-8, 7] and float16 scales
    [N, K/group], a group's largest magnitude mapped to -8 (its scale negative where that is the
    largest positive value)."""
    grouped = weight.float().unflatten(-1, (-1, group))
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    largest = torch.where(high < -low, -low, -high)
    scales = (largest / 8).to(torch.float16)
    scales = torch.where(scales < 0, scales.clamp(max=-1e-5), scales.clamp(min=1e-5))
    q = torch.round(grouped / scales[..., None]).clamp(-8, 7)
    return q.flatten(-2).to(torch.int8), scales


def dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that q and its scales stand for."""
    return (q.float().unflatten(-1, (-1, GROUP_SIZE)) * scales.float()[..., None]).flatten(-2)


def pack(q: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's GPTQ tensors (by suffix) from q [N, K] and scales [N, K/group]: `qweight` [K/8, N],
    input 8i + j of a column in bits 4j.. of word i, each value plus the zero 8; `qzeros`
    [K/group, N/8], the zero less 1 in each nibble; `scales` [K/group, N]; `g_idx` [K]."""
    rows, inputs = q.shape
    nibbles = (q.to(torch.int64) + 8).unflatten(-1, (-1, 8))  # [N, K/8, 8]
    words = (nibbles << (4 * torch.arange(8))).sum(-1)  # [N, K/8], as unsigned 32-bit values
    qweight = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return {"qweight": qweight.t().contiguous(),
            "qzeros": torch.full((inputs // GROUP_SIZE, rows // 8), _ZERO_V1, dtype=torch.int32),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(inputs) // GROUP_SIZE).to(torch.int32)}


def write_gptq(demo: Path, target: Path, flavour: str) -> Path:
    """The demo GPTQ-packed at `target`, its config as AutoRound writes `flavour` (one of FLAVOURS)."""
    tensors = {}
    for name, tensor in load_file(demo / _WEIGHTS).items():
        if not _PACKED.match(name):
            tensors[name] = tensor
            continue
        layer = name.removesuffix(".weight")
        for suffix, stored in pack(*symmetric_int4(tensor, GROUP_SIZE)).items():
            if suffix != "g_idx" or flavour == "gptq":
                tensors[f"{layer}.{suffix}"] = stored
    routers = [name.removesuffix(".weight") for name in tensors if _ROUTER.match(name)]
    return _written(demo, target, tensors, _config(flavour, routers))


def write_dequantized(demo: Path, target: Path) -> Path:
    """The demo with each layer `write_gptq` packs replaced by its dequantized weight, in float32."""
    tensors = {name: dequantized(*symmetric_int4(tensor, GROUP_SIZE)) if _PACKED.match(name) else tensor
               for name, tensor in load_file(demo / _WEIGHTS).items()}
    return _written(demo, target, tensors, None)


def with_quantization_config(checkpoint: Path, target: Path, **changes: object) -> Path:
    """A copy of `checkpoint` whose quantization_config has `changes` (None removes a field)."""
    shutil.copytree(checkpoint, target)
    config = {**json.loads((target / "config.json").read_text(encoding="utf-8"))["quantization_config"], **changes}
    _set_quantization_config(target, {key: value for key, value in config.items() if value is not None})
    return target


def _config(flavour: str, routers: list[str]) -> dict:
    common = {"bits": 4, "group_size": GROUP_SIZE, "sym": True, "data_type": "int", "iters": 0,
              "autoround_version": "0.16.1", "block_name_to_quantize": "thinker.model.layers"}
    if flavour == "gptq":  # `convert_to_autogptq_dynamic`: "-:" and AutoRound's `to_standard_regex` of the name
        dynamic = {f"-:.*{re.escape(router)}.*": {} for router in routers}
        return {**common, "quant_method": "gptq", "provider": "auto-round", "desc_act": False, "lm_head": False,
                "true_sequential": False, "damp_percent": 0.01, "dynamic": dynamic}
    extra = {router: {"bits": 16, "data_type": "float"} for router in routers}
    return {**common, "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "extra_config": extra}


def _written(demo: Path, target: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    shutil.copytree(demo, target, ignore=shutil.ignore_patterns(_WEIGHTS))
    save_file(tensors, target / _WEIGHTS, metadata={"format": "pt"})
    if quantization is not None:
        _set_quantization_config(target, quantization)
    return target


def _set_quantization_config(checkpoint: Path, quantization: dict) -> None:
    written = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    written["quantization_config"] = quantization
    (checkpoint / "config.json").write_text(json.dumps(written, indent=2), encoding="utf-8")
