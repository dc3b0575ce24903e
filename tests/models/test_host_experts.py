"""The experts of the Thinker's last layers, and its input embeddings, in host memory
(model/host_experts.py, model/mapped_memory.py): `experts_on_gpu` = N marks the layers past the
first N in every weights format, the memory plan the embeddings where the KV target does not fit;
their weights load into page-locked host memory that torch sees as CUDA tensors (never the caching
allocator's), and the app answers token for token as with them on the GPU, CUDA graphs on. On the
CPU every tensor is host memory already: the same tests check the marks there, and that nothing moved."""

import ctypes

import numpy as np
import pytest
import torch

from device_under_test import TEST_DEVICE
from omni_local.api import OmniLocal
from omni_local.engine.sizing import memory_plan
from omni_local.model.mapped_memory import mapped_empty
from omni_local.model.host_experts import (embeddings_in_host_memory, held_in_host_memory, host_layers, in_host_memory,
                                           layers_in_host_memory, move_to_host_memory, thinker_experts)
from omni_local.model.loader import load_model
from omni_local.model.quantized.linear import has_fp8_units

ON_GPU = TEST_DEVICE == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="mapped host memory is a GPU's: run with OMNI_LOCAL_TEST_DEVICE=cuda")
QUESTION = "Tell me about the lighthouse on the rock."


def formats() -> list[str]:
    runs_fp8 = not ON_GPU or has_fp8_units(torch.device("cuda"))
    return ["bf16", *(["fp8"] if runs_fp8 else []), "int4"]


def allocator_ranges() -> list[tuple[int, int]]:
    """The address ranges of the caching allocator's segments: every device allocation torch made."""
    return [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]


def is_device_allocation(tensor: torch.Tensor) -> bool:
    return any(first <= tensor.data_ptr() < last for first, last in allocator_ranges())


def expert_tensors(model: torch.nn.Module, layer: int) -> list[torch.Tensor]:
    experts = thinker_experts(model)[layer]
    return [*experts.parameters(), *experts.buffers()]


def test_the_experts_in_host_memory_are_the_last_layers_past_the_first_n():
    assert host_layers(4, 1) == range(1, 4)
    assert host_layers(4, 0) == range(0, 4)
    assert host_layers(4, 9) == range(4, 4)


@pytest.mark.parametrize("weights", formats())
def test_experts_on_gpu_marks_the_layers_past_the_first_n_quantized_as_they_load_or_read_back_from_the_store(
    demo_settings, demo_checkpoint, tmp_path, weights
):
    settings = demo_settings.replace(weights=weights, experts_on_gpu=1, cache_dir=str(tmp_path / "cache"))
    for _ in range(2):  # quantized from the checkpoint, then (fp8, int4) read back from the store
        model = load_model(settings).model
        assert [in_host_memory(e) for e in thinker_experts(model)] == [False, True, True, True]
        expected = [1, 2, 3] if ON_GPU else []  # on the CPU nothing is moved: it is host memory already
        assert layers_in_host_memory(model) == expected
        assert held_in_host_memory(model) == sum(t.nbytes for layer in expected for t in expert_tensors(model, layer))
        if ON_GPU:
            assert not any(is_device_allocation(t) for layer in expected for t in expert_tensors(model, layer))
            assert all(is_device_allocation(t) for t in expert_tensors(model, 0))


def test_a_checkpoint_quantized_before_loading_holds_the_experts_past_the_first_n_in_host_memory(
    demo_settings, demo_checkpoint, tmp_path
):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the checkpoint")
    from compressed_checkpoints import write_compressed

    checkpoint = write_compressed(demo_checkpoint, tmp_path / "w4a16", "W4A16")
    model = load_model(demo_settings.replace(model=str(checkpoint), experts_on_gpu=2)).model

    assert [in_host_memory(e) for e in thinker_experts(model)] == [False, False, True, True]
    assert layers_in_host_memory(model) == ([2, 3] if ON_GPU else [])


@pytest.mark.parametrize("weights", formats())
def test_the_app_with_experts_in_host_memory_answers_token_for_token_as_with_every_expert_on_the_gpu(
    demo_settings, demo_checkpoint, weights
):
    replies = []
    for experts_on_gpu in (-1, 2):  # the demo fits: -1 keeps every layer's experts on the GPU
        with OmniLocal(demo_settings.replace(weights=weights, experts_on_gpu=experts_on_gpu)) as app:
            assert app.settings.cuda_graphs
            replies.append(app.session().send(QUESTION, max_new_tokens=24).result().token_ids)
            assert layers_in_host_memory(app.backend.loaded.model) == ([2, 3] if experts_on_gpu == 2 and ON_GPU
                                                                       else [])
    assert replies[1] == replies[0] and len(replies[0]) > 0


@gpu_only
def test_deterministic_replies_with_experts_in_host_memory_are_those_with_every_expert_on_the_gpu(
    demo_settings, demo_checkpoint
):
    replies = []
    for experts_on_gpu in (-1, 1):
        with OmniLocal(demo_settings.replace(weights="int4", deterministic=True, experts_on_gpu=experts_on_gpu)) as app:
            replies.append([app.session().send(QUESTION, max_new_tokens=24).result().token_ids for _ in range(2)])
    assert replies[1] == replies[0]


def test_moving_a_loaded_models_experts_to_host_memory_keeps_their_values_and_frees_their_gpu_copies(
    demo_settings, demo_checkpoint
):
    model = load_model(demo_settings).model
    before = [t.clone() for t in expert_tensors(model, 3)]

    move_to_host_memory(model, 3, embeddings=False)

    assert [in_host_memory(e) for e in thinker_experts(model)] == [False, False, False, True]
    after = expert_tensors(model, 3)
    assert all(torch.equal(a, b) and a.device == b.device for a, b in zip(after, before))
    if ON_GPU:
        assert layers_in_host_memory(model) == [3] and not any(is_device_allocation(t) for t in after)


@gpu_only
def test_mapped_memory_is_host_memory_that_kernels_read_and_write_in_place_and_no_device_allocation():
    device = torch.device("cuda", torch.cuda.current_device())
    allocated = torch.cuda.memory_allocated(device)

    mapped = mapped_empty((256, 64), torch.float32, device)

    assert mapped.is_cuda and mapped.device == device and mapped.shape == (256, 64)
    assert torch.cuda.memory_allocated(device) == allocated and not is_device_allocation(mapped)
    # The host sees the same bytes at the same address: what a kernel writes, and what the host writes.
    host = np.ctypeslib.as_array((ctypes.c_float * mapped.numel()).from_address(mapped.data_ptr()))
    mapped.fill_(1.5)
    torch.cuda.synchronize()
    assert (host == 1.5).all()
    host[:] = np.arange(mapped.numel(), dtype=np.float32)
    assert torch.equal(mapped.flatten().cpu(), torch.arange(mapped.numel(), dtype=torch.float32))
    assert (mapped * 2).sum().item() == float(np.arange(mapped.numel()).sum() * 2)



def embedding_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    table = model.thinker.get_input_embeddings()
    return [*table.parameters(), *table.buffers()]


def short_of_the_kv_target(settings, tmp_path) -> object:
    """`settings` with `gpu_memory_bytes` a byte short of the memory plan's KV target beside the
    weights, the first start's engine and the encoder outputs' floor: the plan puts the input
    embeddings in host memory, no experts. (A cache folder of its own: no measured engine take.)"""
    from omni_local.engine.sizing.kv_sizes import kv_sizes
    from omni_local.model.quantized import weights_bytes

    model = load_model(settings).model
    kv = kv_sizes(model, settings)
    least_encoder = min(settings.encoder_cache_bytes, memory_plan.LEAST_ENCODER_CACHE_BYTES)
    target = kv.bytes(kv.blocks_for(memory_plan.KV_TARGET_TOKENS))
    available = (weights_bytes(model, settings.weights, settings.speech) + memory_plan.FIRST_START_ENGINE_BYTES
                 + least_encoder + target - 1)
    return settings.replace(gpu_memory_bytes=available, gpu_cache_bytes=1 << 30, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("weights", formats())
def test_the_app_with_the_input_embeddings_in_host_memory_answers_token_for_token_as_with_them_on_the_gpu(
    demo_settings, demo_checkpoint, tmp_path, weights
):
    settings = demo_settings.replace(weights=weights)
    replies = []
    for where in ("gpu", "host"):
        planned = settings if where == "gpu" else short_of_the_kv_target(settings, tmp_path / where)
        with OmniLocal(planned) as app:
            assert app.settings.cuda_graphs
            model = app.backend.loaded.model
            assert in_host_memory(model.thinker.get_input_embeddings()) == (where == "host")
            assert layers_in_host_memory(model) == []
            assert embeddings_in_host_memory(model) == (where == "host" and ON_GPU)
            if ON_GPU and where == "host":
                assert not any(is_device_allocation(t) for t in embedding_tensors(model))
                assert held_in_host_memory(model) == sum(t.nbytes for t in embedding_tensors(model))
            replies.append(app.session().send(QUESTION, max_new_tokens=24).result().token_ids)
    assert replies[1] == replies[0] and len(replies[0]) > 0


def test_moving_a_loaded_models_input_embeddings_to_host_memory_keeps_their_values_and_frees_their_gpu_copy(
    demo_settings, demo_checkpoint
):
    model = load_model(demo_settings.replace(weights="int4")).model
    before = [t.clone() for t in embedding_tensors(model)]

    move_to_host_memory(model, 4, embeddings=True)

    assert in_host_memory(model.thinker.get_input_embeddings()) and layers_in_host_memory(model) == []
    after = embedding_tensors(model)
    assert len(after) == 2 and all(torch.equal(a, b) and a.device == b.device for a, b in zip(after, before))
    if ON_GPU:
        assert embeddings_in_host_memory(model) and not any(is_device_allocation(t) for t in after)
