"""Whether our Triton kernels (the MoE's, attention's) can run on a device, what they share, the
GPU their tiles are chosen for (`kernel_gpu`), and whether it has FP8 (`has_fp8_units`)."""

import importlib.util
import os
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch

from omni_local.errors import SettingsError

# bfloat16 tl.dot, and the kernels' tiles, need Ampere or newer.
MIN_CAPABILITY = (8, 0)
# float8 e4m3: Triton's conversions and FP8 matrix units (torch._scaled_mm), from Ada on.
FP8_CAPABILITY = (8, 9)


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
    capability = kernel_gpu(device).capability
    if capability < MIN_CAPABILITY:
        return (f"this GPU's compute capability is {capability[0]}.{capability[1]}, and the kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return None


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 products in full precision, as torch's float32 matmuls (TF32 off); None (Triton's
    default) for 16-bit inputs, whose products are exact."""
    return "ieee" if dtype == torch.float32 else None


# Makes the engine choose kernels and tiles, and refuse what the architecture lacks (fp8 below 8.9),
# as on a GPU of this architecture ("86": compute capability 8.6), whatever the GPU: on an H100, the
# non-Hopper choices can be tested. Triton still compiles for the GPU present (a cubin runs only on
# its own major architecture); tests/unit/test_kernel_builds.py compiles them for each architecture.
FORCE_ARCH_VARIABLE = "OMNI_LOCAL_FORCE_ARCH"


@dataclass(frozen=True)
class KernelGpu:
    """What our kernels' choices depend on: the compute capability, and the GPU's name, by which
    tuned tile tables are kept (None where the architecture is forced: that architecture's defaults)."""

    name: str | None
    capability: tuple[int, int]


# The GPU engine/kernel_builds.py builds the engine's kernels for, its tensors on the meta device.
building_for: ContextVar[KernelGpu | None] = ContextVar("building_for", default=None)


def kernel_gpu(device: torch.device) -> KernelGpu | None:
    """The GPU our kernels are chosen for on `device`: None off CUDA (Triton's interpreter), the meta
    device's `building_for`, else the GPU's own (its capability OMNI_LOCAL_FORCE_ARCH's where set)."""
    if device.type == "meta":
        return building_for.get()
    if device.type != "cuda":
        return None
    return _cuda_gpu(device)


@cache  # read once a device: the variable is set before the engine starts
def _cuda_gpu(device: torch.device) -> KernelGpu:
    forced = os.environ.get(FORCE_ARCH_VARIABLE)
    if forced:
        return KernelGpu(None, forced_capability(forced))
    return KernelGpu(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


def forced_capability(value: str) -> tuple[int, int]:
    """The compute capability OMNI_LOCAL_FORCE_ARCH names: '86' is 8.6, '120' 12.0."""
    if not value.isdigit() or int(value) < 10:
        raise SettingsError(f"{FORCE_ARCH_VARIABLE} names an architecture as its compute capability's digits "
                            f"('80', '86', '89', '90', '100', '120'), not {value!r}")
    return divmod(int(value), 10)


def has_fp8_units(device: torch.device) -> bool:
    """Whether `device` is a GPU with FP8 (Ada, Hopper and newer), by the capability our kernels are
    chosen for: OMNI_LOCAL_FORCE_ARCH's where set, the meta device's `building_for`."""
    gpu = kernel_gpu(device)
    return gpu is not None and gpu.capability >= FP8_CAPABILITY


def refuse_without_fp8(setting: str, instead: str, device: torch.device) -> None:
    """A SettingsError where `device` is a CUDA GPU without FP8: `setting` (what asked for fp8) cannot
    run there, and `instead` says what does. fp8 weights and fp8 KV are refused by this one check, so
    a forced architecture refuses both as that GPU would. (The CPU runs fp8 in torch's conversions.)"""
    if device.type != "cuda" or has_fp8_units(device):
        return
    major, minor = kernel_gpu(device).capability
    raise SettingsError(f"{setting}, but this GPU's compute capability is {major}.{minor}, and fp8 needs "
                        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell): {instead}")
