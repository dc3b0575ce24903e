"""The GPU our kernels are chosen for: its own name and compute capability, or with
OMNI_LOCAL_FORCE_ARCH another architecture's (that architecture's default tiles, not the GPU's tuned
ones, and its refusals), so the non-Hopper choices run on an H100; and fp8 weights and fp8 KV
refused below compute capability 8.9 by that capability, naming int4. The GPU is stood in for on the
CPU (torch.cuda's answers)."""

import pytest
import torch

from omni_local.engine.memory import kv_fp8
from omni_local.kernels import triton_support
from omni_local.kernels.gemv_tiles import DEFAULT, TUNED, gemv_tile
from omni_local.kernels.moe.tile_configs import SMALL_BATCH_DEFAULT, tile_config
from omni_local.kernels.triton_support import FORCE_ARCH_VARIABLE, KernelGpu, has_fp8_units, kernel_gpu
from omni_local.errors import SettingsError
from omni_local.model import loader
from omni_local.settings import Settings

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """Makes torch.cuda answer as the GPU `gpu(name, capability)` names, read afresh."""

    def stand_in(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        triton_support._cuda_gpu.cache_clear()

    monkeypatch.delenv(FORCE_ARCH_VARIABLE, raising=False)
    yield stand_in
    triton_support._cuda_gpu.cache_clear()


def test_a_gpu_is_its_own_name_and_capability_and_a_forced_one_the_architectures_alone(gpu, monkeypatch):
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert kernel_gpu(CUDA) == KernelGpu("NVIDIA H100 80GB HBM3", (9, 0))

    monkeypatch.setenv(FORCE_ARCH_VARIABLE, "120")
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert kernel_gpu(CUDA) == KernelGpu(None, (12, 0))


def test_a_forced_architecture_takes_its_default_tiles_where_the_gpu_has_tuned_ones(gpu, monkeypatch):
    gpu("NVIDIA H200", (9, 0))
    assert gemv_tile(4096, 2048, CUDA) == TUNED[("NVIDIA H200", 4096, 2048)] != DEFAULT
    assert tile_config(128, 2048, 768, 1, CUDA) != SMALL_BATCH_DEFAULT

    monkeypatch.setenv(FORCE_ARCH_VARIABLE, "86")
    gpu("NVIDIA H200", (9, 0))
    assert gemv_tile(4096, 2048, CUDA) == DEFAULT
    assert tile_config(128, 2048, 768, 1, CUDA) == SMALL_BATCH_DEFAULT


def test_a_forced_architecture_below_8_9_has_no_fp8_units_on_a_gpu_that_has(gpu, monkeypatch):
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert has_fp8_units(CUDA)

    monkeypatch.setenv(FORCE_ARCH_VARIABLE, "86")
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert not has_fp8_units(CUDA)


@pytest.mark.parametrize("value", ["8.6", "sm_86", "9"])
def test_a_force_arch_value_that_names_no_architecture_is_a_settings_error(gpu, monkeypatch, value):
    monkeypatch.setenv(FORCE_ARCH_VARIABLE, value)
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    with pytest.raises(SettingsError, match=f"{FORCE_ARCH_VARIABLE} names an architecture"):
        kernel_gpu(CUDA)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_fp8_weights_below_compute_capability_8_9_are_refused_naming_int4(gpu, capability):
    gpu("An Ampere GPU", capability)
    with pytest.raises(SettingsError) as refused:
        loader._check_weights(["fp8"], False, Settings(weights="fp8"), CUDA)

    assert str(refused.value) == (f"setting 'weights' is 'fp8', but this GPU's compute capability is {capability[0]}."
                                  f"{capability[1]}, and fp8 needs 8.9 or newer (Ada, Hopper, Blackwell): use "
                                  "weights = 'int4'")


def test_an_fp8_checkpoint_below_compute_capability_8_9_is_refused_naming_int4(gpu):
    gpu("An Ampere GPU", (8, 6))
    with pytest.raises(SettingsError) as refused:
        loader._check_weights(["fp8"], True, Settings(weights="bf16"), CUDA)

    assert str(refused.value).startswith("the checkpoint holds fp8 weights, but this GPU's compute capability is 8.6")
    assert str(refused.value).endswith(": an int4 checkpoint runs here, or a bf16 one with weights = 'int4'")


def test_fp8_weights_from_8_9_on_are_taken(gpu):
    gpu("An Ada GPU", (8, 9))
    loader._check_weights(["fp8"], False, Settings(weights="fp8"), CUDA)


def test_a_forced_architecture_below_8_9_refuses_fp8_weights_and_fp8_kv_on_a_gpu_that_has_fp8(gpu, monkeypatch):
    monkeypatch.setenv(FORCE_ARCH_VARIABLE, "86")
    gpu("NVIDIA H100 80GB HBM3", (9, 0))

    with pytest.raises(SettingsError, match="compute capability is 8.6.*use weights = 'int4'"):
        loader._check_weights(["fp8"], False, Settings(weights="fp8"), CUDA)
    with pytest.raises(SettingsError, match="compute capability is 8.6.*use kv_dtype = 'auto'"):
        kv_fp8.fp8_kv("fp8", CUDA)
