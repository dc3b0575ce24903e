"""Whether our Triton kernels (the MoE's, attention's) can run on a device, and what they share."""

import importlib.util
import os

import torch

from omni_local.errors import SettingsError

# bfloat16 tl.dot, and the kernels' tiles, need Ampere or newer.
MIN_CAPABILITY = (8, 0)


def uses_triton(name: str, setting: str, device: torch.device) -> bool:
    """Whether setting `name` ('torch', 'triton' or 'auto') picks our Triton kernels on `device`:
    'auto' does on a CUDA GPU that runs them. 'triton' where they cannot run is a SettingsError
    saying why."""
    if setting == "torch":
        return False
    refusal = triton_refusal(device)
    if setting == "auto":
        return refusal is None and device.type == "cuda"
    if refusal:
        raise SettingsError(f"setting '{name}' is 'triton', but {refusal}: use 'torch' or 'auto'")
    return True


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


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 products in full precision, as torch's float32 matmuls (TF32 off); None (Triton's
    default) for 16-bit inputs, whose products are exact."""
    return "ieee" if dtype == torch.float32 else None
