"""The `moe_backend` setting, made a backend for the model's device: 'auto' is triton on a CUDA GPU
that runs it, torch elsewhere; 'triton' where Triton cannot run is a SettingsError saying why."""

import torch

from omni_local.engine.forward.moe.backend import MoeBackend
from omni_local.engine.forward.moe.torch_backend import TORCH
from omni_local.kernels.triton_support import uses_triton


def moe_backend(setting: str, device: torch.device, batch_invariant: bool = False) -> MoeBackend:
    """`batch_invariant` (the deterministic setting) takes the triton backend in its invariant form."""
    if not uses_triton("moe_backend", setting, device):
        return TORCH
    from omni_local.engine.forward.moe.triton_backend import TritonMoe  # imports triton

    return TritonMoe(batch_invariant)
