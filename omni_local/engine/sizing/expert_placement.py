"""Where the GPU memory plan (memory_plan.py) puts the Thinker's input embeddings and routed experts:
whether the embeddings and how many of the first layers' experts stay on the GPU, the rest in
page-locked host memory (model/host_experts.py), and what that costs.

- The embeddings go first, where the weights leave less than the plan's KV target (or its floors):
  a token reads one row of them, a few KiB over the bus.

- `experts_on_gpu` = N keeps the first N layers' experts on the GPU; -1 (AUTO) all of them where the
  weights fit beside the plan's floors, else the most that leave the fewest last layers' experts to
  host memory to make the floors fit.
- A decoded token reads its top-k routed experts of each layer in host memory over the bus:
  top-k x one expert's bytes x those layers (at full size in int4, 8 experts of about 2.4 MB a layer).
- Page-locked memory is memory the OS can neither swap out nor give to anything else: the experts
  there may take at most 1 / HOST_SHARE of the machine's memory (machine_memory.py); the rest is for
  the OS, the desktop's programs, this process, the page cache the checkpoint is read through and the
  KV's host tier.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from omni_local.engine.sizing.machine_memory import machine_memory_bytes
from omni_local.model.host_experts import AUTO, host_layers, thinker_embeddings, thinker_experts
from omni_local.model.quantized import (QuantizedEmbedding, QuantizedExperts, layer_formats, quantized_places,
                                       stored_bytes, weights_bytes)

HOST_SHARE = 2
# What the plan's line prices the bus at: PCIe 4.0 x16, about 25 GB/s of the 32 it is rated for.
BUS_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Placement:
    experts_on_gpu: int  # the first Thinker layers whose experts stay on the GPU
    layers: int  # the Thinker's layers
    device_weights: int  # every weight's bytes on the GPU
    host_experts: int  # the bytes of the experts in host memory
    host_embeddings: int  # the bytes of the Thinker's input embeddings in host memory (0: on the GPU)

    @property
    def host_layers(self) -> range:
        return host_layers(self.layers, self.experts_on_gpu)

    def fits(self, room: int, host_most: int | None) -> bool:
        """Whether the weights fit `room` bytes of GPU memory, and those in host memory its share
        `host_most` (None: not known, no bound)."""
        host = self.host_experts + self.host_embeddings
        return self.device_weights <= room and (host_most is None or host <= host_most)


def place_weights(model: torch.nn.Module, weights: str, speech: bool, setting: int, room: int, roomy: int
                  ) -> Placement:
    """Where `experts_on_gpu` = `setting` puts the experts of `model` (loaded, or empty: see
    `layer_experts_bytes`) with `weights`, where the weights may take `room` bytes of GPU memory, and
    whether the embeddings go to host memory: where the weights, the experts `setting` keeps on the GPU
    among them, take more than `roomy` bytes (the room the KV target leaves them)."""
    layers = layer_experts_bytes(model, weights)
    whole = weights_bytes(model, weights, speech)
    kept = experts_on_gpu(setting, layers, 0)  # AUTO: every layer's
    embeddings = embeddings_bytes(model, weights, speech) if whole - sum(layers[kept:]) > roomy else 0
    on_gpu = experts_on_gpu(setting, layers, whole - embeddings - room)
    host = sum(layers[on_gpu:])
    return Placement(on_gpu, len(layers), whole - embeddings - host, host, embeddings)


def experts_on_gpu(setting: int, layers: list[int], short: int) -> int:
    """How many of the first Thinker layers keep their experts on the GPU: `setting` (AUTO: all, unless
    the GPU is `short` of bytes; then the most that leave the experts of at least `short` bytes, of
    the last layers, to host memory; none where no number does). `layers`: each layer's experts' bytes."""
    if setting != AUTO:
        return min(setting, len(layers))
    for on_gpu in range(len(layers), -1, -1):
        if sum(layers[on_gpu:]) >= short:
            return on_gpu
    return 0


def host_experts_most() -> int | None:
    """The most bytes of experts the plan may page-lock in host memory; None where the machine's
    memory cannot be read."""
    machine = machine_memory_bytes()
    return None if machine is None else machine // HOST_SHARE


def layer_experts_bytes(model: torch.nn.Module, weights: str) -> list[int]:
    """The bytes each Thinker layer's experts take with `weights` (0 for a dense layer), for `model`
    loaded or still empty (its full-precision experts on the meta device, or a checkpoint's quantized
    ones not filled yet)."""
    dtype = next(model.parameters()).dtype
    return [_experts_bytes(experts, weights, dtype) for experts in thinker_experts(model)]


def embeddings_bytes(model: torch.nn.Module, weights: str, speech: bool) -> int:
    """The bytes of the Thinker's input embeddings with `weights` (int4 keeps them in int8); 0 where
    they cannot leave the GPU (tied to lm_head)."""
    table = thinker_embeddings(model)
    if table is None:
        return 0
    dtype = next(model.parameters()).dtype
    if isinstance(table, QuantizedEmbedding):  # ours, once loaded
        return table.planned_bytes(dtype)
    formats = {id(getattr(parent, name)): format for parent, name, format in quantized_places(model, weights, speech)}
    return stored_bytes(table, formats[id(table)], dtype) if id(table) in formats else table.weight.numel() * dtype.itemsize


def bus_bytes_per_token(model: torch.nn.Module, weights: str, layers: Iterable[int], embeddings: bool) -> int:
    """The bytes a decoded token reads from host memory: its top-k routed experts in each of Thinker
    `layers` (each expert of a layer weighs the same), and its row of the embeddings if `embeddings`."""
    config = model.thinker.model.language_model.config
    each = layer_experts_bytes(model, weights)
    row = embeddings_bytes(model, weights, True) // config.vocab_size if embeddings else 0
    return row + sum(each[i] // config.num_experts * config.num_experts_per_tok for i in layers)


def _experts_bytes(experts: torch.nn.Module | None, weights: str, dtype: torch.dtype) -> int:
    if experts is None:
        return 0
    if isinstance(experts, QuantizedExperts):  # a checkpoint's, or ours once loaded
        return experts.planned_bytes(dtype)
    if weights == "bf16":
        return (experts.gate_up_proj.numel() + experts.down_proj.numel()) * dtype.itemsize
    return stored_bytes(experts, layer_formats(weights)[1], dtype)
