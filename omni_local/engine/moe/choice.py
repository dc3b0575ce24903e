"""The `moe_backend` setting, made a backend for the model's device: 'auto' is triton on a CUDA GPU
that runs it, torch elsewhere; 'triton' where Triton cannot run is a SettingsError saying why."""

import importlib.util
import os

import torch

from omni_local.engine.moe.backend import MoeBackend
from omni_local.engine.moe.torch_backend import TORCH
from omni_local.errors import SettingsError

# bfloat16 tl.dot, and the kernels' tiles, need Ampere or newer.
MIN_CAPABILITY = (8, 0)


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


def triton_refusal(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on `device`, or None where they can. On the CPU they run only
    under Triton's interpreter (TRITON_INTERPRET=1, set before they are first imported): the tests."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (torch's CUDA wheels bring it)"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "the model runs on the CPU, and Triton's kernels need a CUDA GPU"
    if device.type != "cuda":
        return f"the model runs on '{device.type}', and Triton's kernels need a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"this GPU's compute capability is {capability[0]}.{capability[1]}, and the kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return None
