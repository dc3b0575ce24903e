"""The settings that pick our Triton kernels (`moe_backend`, `attention_backend`, `deterministic`): 'auto'
is torch off CUDA, 'torch' is torch everywhere, and 'triton' (or deterministic) where Triton cannot run
is refused, saying why."""

import pytest
import torch

from omni_local.engine.forward.moe import TORCH, moe_backend
from omni_local.engine.memory.attention import attention_kernels, backend_kernel
from omni_local.errors import SettingsError

# setting -> (what makes the setting's choice, what it gives for torch)
CHOICES = {"moe_backend": (moe_backend, TORCH), "attention_backend": (backend_kernel, None)}


@pytest.mark.parametrize("name", CHOICES)
def test_auto_is_torch_off_cuda_and_torch_is_torch_everywhere(name):
    choose, torch_choice = CHOICES[name]
    assert choose("auto", torch.device("cpu")) is torch_choice
    assert choose("torch", torch.device("cpu")) is torch_choice


@pytest.mark.parametrize("name", CHOICES)
def test_triton_where_triton_cannot_run_is_a_settings_error_saying_why(monkeypatch, name):
    choose, _ = CHOICES[name]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SettingsError, match=f"'{name}' is 'triton', but the model runs on the CPU"):
        choose("triton", torch.device("cpu"))


def test_the_deterministic_setting_where_triton_cannot_run_is_a_settings_error_saying_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SettingsError, match="'deterministic' runs our Triton kernels, but the model runs on the CPU"):
        attention_kernels("auto", torch.device("cpu"), deterministic=True)


def test_the_deterministic_setting_attends_with_our_kernel_in_every_forward():
    kernels = attention_kernels("auto", torch.device("cpu"), deterministic=True)  # the interpreter runs it here

    assert kernels.decode is kernels.prefill and kernels.decode.keywords == {"batch_invariant": True}
