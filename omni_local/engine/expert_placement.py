"""Where the GPU memory plan (memory_plan.py) puts the Thinker's routed experts: how many of the first
layers keep theirs on the GPU, the rest in page-locked host memory (model/host_experts.py), and what
that costs.

- `experts_on_gpu` = N keeps the first N layers' experts on the GPU; -1 (AUTO) all of them where the
  weights fit beside the plan's floors, else the most that leave the fewest last layers' experts to
  host memory to make them fit.
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

from omni_local.engine.machine_memory import machine_memory_bytes
from omni_local.model.host_experts import AUTO, host_layers, thinker_experts
from omni_local.model.quantized import QuantizedExperts, layer_formats, stored_bytes, weights_bytes

HOST_SHARE = 2
# What the plan's line prices the bus at: PCIe 4.0 x16, about 25 GB/s of the 32 it is rated for.
BUS_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Placement:
    experts_on_gpu: int  # the first Thinker layers whose experts stay on the GPU
    layers: int  # the Thinker's layers
    device_weights: int  # every weight's bytes on the GPU
    host_experts: int  # the bytes of the experts in host memory

    @property
    def host_layers(self) -> range:
        return host_layers(self.layers, self.experts_on_gpu)

    def fits(self, room: int, host_most: int | None) -> bool:
        """Whether the weights fit `room` bytes of GPU memory, and the experts in host memory its share
        `host_most` (None: not known, no bound)."""
        return self.device_weights <= room and (host_most is None or self.host_experts <= host_most)


def place_experts(model: torch.nn.Module, weights: str, speech: bool, setting: int, room: int) -> Placement:
    """Where `experts_on_gpu` = `setting` puts the experts of `model` (loaded, or empty: see
    `layer_experts_bytes`) with `weights`, where the weights may take `room` bytes of GPU memory."""
    layers = layer_experts_bytes(model, weights)
    whole = weights_bytes(model, weights, speech)
    on_gpu = experts_on_gpu(setting, layers, whole - room)
    host = sum(layers[on_gpu:])
    return Placement(on_gpu, len(layers), whole - host, host)


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


def bus_bytes_per_token(model: torch.nn.Module, weights: str, layers: Iterable[int]) -> int:
    """The expert bytes a decoded token reads from host memory: its top-k routed experts in each of
    Thinker `layers` (each expert of a layer weighs the same)."""
    config = model.thinker.model.language_model.config
    each = layer_experts_bytes(model, weights)
    return sum(each[i] // config.num_experts * config.num_experts_per_tok for i in layers)


def _experts_bytes(experts: torch.nn.Module | None, weights: str, dtype: torch.dtype) -> int:
    if experts is None:
        return 0
    if isinstance(experts, QuantizedExperts):  # a checkpoint's, or ours once loaded
        return experts.planned_bytes(dtype)
    if weights == "bf16":
        return (experts.gate_up_proj.numel() + experts.down_proj.numel()) * dtype.itemsize
    return stored_bytes(experts, layer_formats(weights)[1], dtype)
