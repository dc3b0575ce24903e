"""The `moe_backend` setting, made a backend for the model's device: 'auto' is triton on a CUDA GPU
that runs it, torch elsewhere; 'triton' where Triton cannot run is a SettingsError saying why."""

import torch

from omni_local.engine.moe.backend import MoeBackend
from omni_local.engine.moe.torch_backend import TORCH
from omni_local.engine.triton_support import triton_refusal
from omni_local.errors import SettingsError


def moe_backend(setting: str, device: torch.device) -> MoeBackend:
    if setting == "torch":
        return TORCH
    refusal = triton_refusal(device)
    if setting == "auto" and (refusal or device.type != "cuda"):
        return TORCH
    if refusal:
        raise SettingsError(f"setting 'moe_backend' is 'triton', but {refusal}: use 'torch' or 'auto'")
    from omni_local.engine.moe.triton_backend import TritonMoe  # imports triton

    return TritonMoe()
