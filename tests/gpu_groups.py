"""The GPU tests, in one place: the test files whose behaviour depends on running on a CUDA GPU (CUDA
graphs, our compiled Triton kernels, compiled layers, page-locked memory, tensors on the device), in
groups that each finish in under 8 minutes on one H100 (docs/testing.md has their times).

conftest.py marks every test of these files `gpu` and `gpu_<group>`, so one command runs a group:

    OMNI_LOCAL_TEST_DEVICE=cuda python -m pytest -m gpu_kernels

On the CPU (the README's test command) the same tests run too, where they can: the demo model on the
CPU and our kernels in Triton's interpreter; the ones that need the GPU skip, saying why.
"""

from pathlib import Path

GROUPS: dict[str, tuple[str, ...]] = {
    # Our Triton kernels and the compiled regions around them, each tested against a plain-PyTorch oracle.
    "kernels": (
        "test_attention_backends.py", "test_compiled_encoders.py", "test_compiled_layers.py",
        "test_graph_writers.py", "test_moe_backends.py", "test_moe_on_gpu.py", "test_paged_attention.py",
        "test_quantized_gemv.py", "test_rope_positions.py", "test_sampling.py",
    ),
    # The engine on the GPU: graphed steps and prefills, the prefix cache and host tier, scheduling.
    "engine": (
        "test_chunked_prefill.py", "test_cuda_graphs.py", "test_deterministic.py", "test_engine_requests.py",
        "test_fp8_kv.py",
        "test_graphs_after_ready.py", "test_host_arena.py", "test_long_chats.py", "test_memory_plan.py",
        "test_poisoned_requests.py", "test_preemption.py", "test_prefix_cache.py", "test_prompt_building.py",
        "test_thinker_parity.py",
    ),
    # The checkpoints, weights formats and media beyond text: speech, video, quantized weights.
    "models": (
        "test_checkpoint_family.py", "test_gptq_checkpoints.py", "test_host_experts.py", "test_media_device.py",
        "test_quantized_app.py",
        "test_quantized_checkpoints.py", "test_quantized_weights.py", "test_speech.py", "test_video.py",
        "test_vocoder_graphs.py", "test_weight_quality.py",
    ),
}


def group_of(test_file: Path) -> str | None:
    """The GPU group a test file belongs to, or None for a test file that does not need the GPU."""
    return next((group for group, files in GROUPS.items() if test_file.name in files), None)
