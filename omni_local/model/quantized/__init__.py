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

from omni_local.model.quantized.experts import QuantizedExperts
from omni_local.model.quantized.formats import QuantFormat, Quantized, dequantize, quantize
from omni_local.model.quantized.linear import QuantizedLinear

WeightsSetting = Literal["bf16", "fp8", "int4"]
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

__all__ = ["QuantizedExperts", "QuantizedLinear", "Quantized", "QuantFormat", "WeightsSetting", "dequantize",
           "quantize", "quantize_layers", "quantized_decoder_stacks"]


def quantized_decoder_stacks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder stacks whose layers are quantized: the Thinker's text model, and the Talker's."""
    stacks = [model.thinker.model.language_model]
    if getattr(model, "talker", None) is not None:
        stacks.append(model.talker.model)
    return stacks


def quantize_layers(model: torch.nn.Module, weights: WeightsSetting) -> None:
    """Put quantized layers in the places `weights` quantizes. On a skeleton whose parameters are on
    the meta device the new layers stay empty until the loader hands them their tensors; on a
    loaded model they are quantized at once, one layer at a time (the full-precision layer is freed
    as its quantized one is made)."""
    if weights == "bf16":
        return
    experts_format: QuantFormat = weights
    dense_format: QuantFormat = "fp8" if weights == "fp8" else "int8"
    for stack in quantized_decoder_stacks(model):
        for layer in stack.layers:
            attention = layer.self_attn
            for name in _ATTENTION_PROJECTIONS:
                setattr(attention, name, QuantizedLinear.replacing(getattr(attention, name), dense_format))
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None and not isinstance(experts, QuantizedExperts):
                layer.mlp.experts = QuantizedExperts.replacing(experts, experts_format)
