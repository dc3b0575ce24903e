"""Quantized weights (the `weights` setting): which of the model's layers are quantized, and how.

`fp8`: the Thinker's and the Talker's routed experts and attention projections in float8.
`int4`: their experts in 4-bit groups, their attention projections in int8 (GPUs without FP8
units run it too); and in int8 (a scale per row) the Thinker's embeddings, its lm_head and every
Linear of its vision and audio encoders. At full size those are 3.4 GiB in bf16: with them in bf16,
int4 with speech weighed 20.5 GiB and ran out of memory on a card capped at 24 GiB (at 23.64 GiB,
capturing CUDA graphs with 1 GiB of KV). fp8, at 35 GiB, is for larger cards and leaves them be.
Everything else keeps the model's dtype: routers and norms (small, and where rounding matters
most), the encoders' convolutions and position tables, the Talker's shared expert, code predictor
and heads (0.4 GiB in all), and Code2Wav. A Thinker whose lm_head is tied to its embeddings (one
tensor) keeps both: quantized, the one table would become two of the same bytes.

A checkpoint quantized before loading (compressed-tensors' W4A16 and FP8) brings its own quantized
layers instead, and nothing else is quantized (the `weights` setting only names its format):
compressed_tensors.py reads its config, prequantized.py places its stored tensors.
"""

from typing import Literal

import torch

from omni_local.model.checkpoint_names import SPEECH_PARTS
from omni_local.model.quantized.embedding import QuantizedEmbedding
from omni_local.model.quantized.experts import QuantizedExperts
from omni_local.model.quantized.formats import QuantFormat, Quantized, dequantize, quantize, quantized_bytes
from omni_local.model.quantized.linear import QuantizedLinear

WeightsSetting = Literal["bf16", "fp8", "int4"]
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUANTIZED_LAYERS = (QuantizedLinear, QuantizedExperts, QuantizedEmbedding)

__all__ = ["ATTENTION_PROJECTIONS", "QUANTIZED_LAYERS", "QuantizedEmbedding", "QuantizedExperts", "QuantizedLinear",
           "Quantized", "QuantFormat", "WeightsSetting", "dequantize", "encoder_towers", "layer_formats", "quantize",
           "quantize_layers", "quantized_decoder_stacks", "quantized_places", "weights_bytes"]


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


def encoder_towers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Thinker's vision and audio encoders."""
    return [model.thinker.model.visual, model.thinker.model.audio_tower]


def quantized_places(model: torch.nn.Module, weights: WeightsSetting, speech: bool = True
                     ) -> list[tuple[torch.nn.Module, str, QuantFormat]]:
    """Where `weights` puts quantized layers, in the full-precision model: (parent module, attribute,
    format) for each attention projection and routed experts module of the quantized stacks, and
    under int4 the Thinker's embeddings, lm_head and encoders' Linears. None in a model that holds
    quantized layers already: a checkpoint's own (the loader quantizes nothing else), or ours."""
    if weights == "bf16" or any(isinstance(module, QUANTIZED_LAYERS) for module in model.modules()):
        return []
    dense, experts = layer_formats(weights)
    places = []
    for stack in quantized_decoder_stacks(model, speech):
        for layer in stack.layers:
            places += [(layer.self_attn, name, dense) for name in ATTENTION_PROJECTIONS]
            if getattr(layer.mlp, "experts", None) is not None:
                places.append((layer.mlp, "experts", experts))
    return places + (_int8_places(model) if weights == "int4" else [])


def _int8_places(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, QuantFormat]]:
    """int4's places in int8 beyond the decoder stacks (see the module's docstring): the embeddings
    and lm_head unless tied, and every Linear of the encoders (none need stay full precision: nothing
    reads their weights but their own forward)."""
    thinker = model.thinker
    tied = "thinker.lm_head.weight" in model.all_tied_weights_keys
    heads = [] if tied else [(thinker.model.language_model, "embed_tokens"), (thinker, "lm_head")]
    linears = [(parent, name) for tower in encoder_towers(model) for parent in tower.modules()
               for name, child in parent.named_children() if isinstance(child, torch.nn.Linear)]
    return [(parent, name, "int8") for parent, name in heads + linears]


def quantize_layers(model: torch.nn.Module, weights: WeightsSetting) -> None:
    """Put quantized layers in the places `weights` quantizes. On a skeleton whose parameters are on
    the meta device the new layers stay empty until the loader hands them their tensors; on a
    loaded model they are quantized at once, one layer at a time (the full-precision layer is freed
    as its quantized one is made)."""
    in_encoders = {id(module) for tower in encoder_towers(model) for module in tower.modules()}
    for parent, name, format in quantized_places(model, weights):
        layer = getattr(parent, name)
        if isinstance(layer, torch.nn.Embedding):
            quantized = QuantizedEmbedding.replacing(layer, format)
        elif isinstance(layer, torch.nn.Linear):
            quantized = QuantizedLinear.replacing(layer, format, batched=id(parent) in in_encoders)
        else:
            quantized = QuantizedExperts.replacing(layer, format)
        setattr(parent, name, quantized)


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
                if isinstance(layer, QUANTIZED_LAYERS) and layer.empty
                and (speech or not name.startswith(SPEECH_PARTS)))
    return plain + empty + sum(stored_bytes(layer, format, dtype) for layer, format in quantized.items())


def stored_bytes(layer: torch.nn.Module, format: QuantFormat, dtype: torch.dtype) -> int:
    """The bytes full-precision `layer` (a Linear, an Embedding, or routed experts) takes quantized to
    `format`."""
    if isinstance(layer, torch.nn.Linear):
        bias = 0 if layer.bias is None else layer.bias.numel() * dtype.itemsize
        return quantized_bytes((layer.out_features, layer.in_features), format, dtype) + bias
    if isinstance(layer, torch.nn.Embedding):
        return quantized_bytes(layer.weight.shape, format, dtype)
    gate_up, down = layer.gate_up_proj.shape, layer.down_proj.shape
    return quantized_bytes(gate_up, format, dtype) + quantized_bytes(down, format, dtype)
