"""Quantized weights (the `weights` setting): which of the model's layers are quantized, and how.

`fp8`: the Thinker's and the Talker's routed experts and attention projections in float8.
`int4`: their experts in 4-bit groups, their attention projections in int8 (GPUs without FP8
units run it too). Everything else keeps the model's dtype: embeddings, lm_head, routers and norms
(small, and where rounding matters most), the encoders, the Talker's shared expert and code
predictor, and Code2Wav.

A checkpoint quantized before loading (compressed-tensors' W4A16 and FP8) brings its own quantized
layers instead: compressed_tensors.py reads its config, prequantized.py places its stored tensors.
"""

from typing import Literal

import torch

from omni_local.model.checkpoint_names import SPEECH_PARTS
from omni_local.model.quantized.experts import QuantizedExperts
from omni_local.model.quantized.formats import QuantFormat, Quantized, dequantize, quantize, quantized_bytes
from omni_local.model.quantized.linear import QuantizedLinear

WeightsSetting = Literal["bf16", "fp8", "int4"]
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_QUANTIZED = (QuantizedLinear, QuantizedExperts)

__all__ = ["ATTENTION_PROJECTIONS", "QuantizedExperts", "QuantizedLinear", "Quantized", "QuantFormat", "WeightsSetting",
           "dequantize", "layer_formats", "quantize", "quantize_layers", "quantized_decoder_stacks", "quantized_places",
           "weights_bytes"]


def quantized_decoder_stacks(model: torch.nn.Module, speech: bool = True) -> list[torch.nn.Module]:
    """The decoder stacks whose layers are quantized: the Thinker's text model, and the Talker's
    (unless `speech` is false)."""
    stacks = [model.thinker.model.language_model]
    if speech and getattr(model, "talker", None) is not None:
        stacks.append(model.talker.model)
    return stacks


def layer_formats(weights: WeightsSetting) -> tuple[QuantFormat, QuantFormat]:
    """The formats of a quantized `weights` setting: (attention projections', routed experts')."""
    assert weights != "bf16", "bf16 quantizes nothing"
    return ("fp8", "fp8") if weights == "fp8" else ("int8", "int4")


def quantized_places(model: torch.nn.Module, weights: WeightsSetting, speech: bool = True
                     ) -> list[tuple[torch.nn.Module, str, QuantFormat]]:
    """Where `weights` puts quantized layers, in the full-precision model: (parent module, attribute,
    format) for each attention projection and routed experts module of the quantized stacks."""
    if weights == "bf16":
        return []
    dense, experts = layer_formats(weights)
    places = []
    for stack in quantized_decoder_stacks(model, speech):
        for layer in stack.layers:
            places += [(layer.self_attn, name, dense) for name in ATTENTION_PROJECTIONS]
            if getattr(layer.mlp, "experts", None) is not None:
                places.append((layer.mlp, "experts", experts))
    return [(parent, name, format) for parent, name, format in places
            if not isinstance(getattr(parent, name), _QUANTIZED)]  # a checkpoint's own, already in place


def quantize_layers(model: torch.nn.Module, weights: WeightsSetting) -> None:
    """Put quantized layers in the places `weights` quantizes. On a skeleton whose parameters are on
    the meta device the new layers stay empty until the loader hands them their tensors; on a
    loaded model they are quantized at once, one layer at a time (the full-precision layer is freed
    as its quantized one is made)."""
    for parent, name, format in quantized_places(model, weights):
        layer = getattr(parent, name)
        kind = QuantizedExperts if name == "experts" else QuantizedLinear
        setattr(parent, name, kind.replacing(layer, format))


def weights_bytes(model: torch.nn.Module, weights: WeightsSetting, speech: bool = True) -> int:
    """The device bytes `model`'s weights will take once loaded with `weights`, the Talker's and
    Code2Wav's left out unless `speech`: its full-precision model (loaded, or a skeleton on the meta
    device) with the quantized places at their stored size."""
    quantized = {getattr(parent, name): format for parent, name, format in quantized_places(model, weights, speech)}
    in_quantized = {id(t) for layer in quantized for t in (*layer.parameters(), *layer.buffers())}
    dtype = next(model.parameters()).dtype
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    plain = sum(t.numel() * t.element_size() for name, t in tensors.items()
                if id(t) not in in_quantized and (speech or not name.startswith(SPEECH_PARTS)))
    # Quantized layers already in place and still empty (a quantized checkpoint's, before loading).
    empty = sum(layer.planned_bytes(dtype) for name, layer in model.named_modules()
                if isinstance(layer, _QUANTIZED) and layer.empty and (speech or not name.startswith(SPEECH_PARTS)))
    return plain + empty + sum(stored_bytes(layer, format, dtype) for layer, format in quantized.items())


def stored_bytes(layer: torch.nn.Module, format: QuantFormat, dtype: torch.dtype) -> int:
    """The bytes full-precision `layer` (a Linear, or routed experts) takes quantized to `format`."""
    if isinstance(layer, torch.nn.Linear):
        bias = 0 if layer.bias is None else layer.bias.numel() * dtype.itemsize
        return quantized_bytes((layer.out_features, layer.in_features), format, dtype) + bias
    gate_up, down = layer.gate_up_proj.shape, layer.down_proj.shape
    return quantized_bytes(gate_up, format, dtype) + quantized_bytes(down, format, dtype)
