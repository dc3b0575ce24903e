"""The triton MoE backend on a CUDA GPU (OMNI_LOCAL_TEST_DEVICE=cuda; skipped elsewhere): the kernels at
Qwen3-Omni's full size in bfloat16 against transformers' experts, captured in a CUDA graph, and the
engine's graphed decode steps and prefills with them giving the torch backend's greedy replies.

The bfloat16 tolerance: against the same computation in float32 (same bfloat16 weights and inputs),
the kernels' output is off by at most 1% in norm (one bfloat16 rounding is 0.4% of a value), and at
its worst element by no more than transformers' own bfloat16 experts are, with a quarter's margin
(they round after each step, the kernels once per GEMM)."""

import pytest
import torch

from device_under_test import TEST_DEVICE
from moe_cases import experts, text_config
from omni_local.api import OmniLocal

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")]

# Qwen3-Omni-30B-A3B's Thinker (../shared/model-configs/qwen3-omni-30b-a3b-instruct.json)
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def full_size():
    """transformers' experts at full size, in bfloat16 and in float32 (the same weights)."""
    config = text_config(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE)
    module = experts(config, torch.bfloat16, "cuda")
    exact = experts(config, torch.float32, "cuda")
    with torch.no_grad():
        exact.gate_up_proj.copy_(module.gate_up_proj)
        exact.down_proj.copy_(module.down_proj)
    return config, module, exact


def tied_free_logits(tokens: int, seed: int) -> torch.Tensor:
    """Router logits [tokens, EXPERTS] in bfloat16, no two alike in a row: the top-k has no ties
    (whose order topk leaves open)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    levels = torch.linspace(-4, 4, EXPERTS, device="cuda").to(torch.bfloat16)
    return levels[torch.argsort(torch.rand((tokens, EXPERTS), generator=generator, device="cuda"), dim=1)]


def routed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's weights and experts for `logits`, as transformers computes them."""
    probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probabilities, TOP_K, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), chosen


@pytest.mark.parametrize("tokens", [1, 4, 16, 128, 512])
@torch.inference_mode()
def test_the_kernels_at_full_size_in_bfloat16_match_transformers_experts(full_size, tokens):
    from omni_local.kernels.moe.routed_experts import weighted_expert_rows

    _, module, exact = full_size
    hidden = torch.randn((tokens, HIDDEN), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
    logits = tied_free_logits(tokens, seed=tokens)
    weights, chosen = routed(logits)
    reference = exact(hidden, chosen, weights.float())
    theirs = module(hidden.bfloat16(), chosen, weights).float()

    ours = weighted_expert_rows(hidden.bfloat16(), logits, module.gate_up_proj, module.down_proj, TOP_K,
                                renormalize=True).sum(dim=1).bfloat16().float()

    assert ((ours - reference).norm() / reference.norm()).item() <= 0.01
    assert (ours - reference).abs().max() <= 1.25 * (theirs - reference).abs().max()


@torch.inference_mode()
def test_the_kernels_replay_in_a_cuda_graph_with_the_eager_result(full_size):
    from omni_local.kernels.moe.routed_experts import weighted_expert_rows

    _, module, _ = full_size
    tokens = 16
    hidden = torch.randn((tokens, HIDDEN), device="cuda", dtype=torch.bfloat16)
    logits = tied_free_logits(tokens, seed=1)

    def run() -> torch.Tensor:
        return weighted_expert_rows(hidden, logits, module.gate_up_proj, module.down_proj, TOP_K, True)

    run()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    hidden.copy_(torch.randn_like(hidden))
    logits.copy_(tied_free_logits(tokens, seed=2))
    graph.replay()

    assert torch.equal(captured, run())


def test_graphed_decode_steps_and_prefills_with_the_triton_backend_give_the_torch_backends_replies(
    on_gpu, demo_settings
):
    engine = on_gpu.backend.engine
    assert engine.runner.regions.moe.name == "triton"  # 'auto' on a GPU
    assert engine.runner.decode_graphs is not None and engine.runner.prefill_graphs is not None
    questions = ["Tell me about lighthouses.", "What do fishermen sing at night? " * 6]
    with OmniLocal(demo_settings.replace(moe_backend="torch")) as torch_app:
        expected = [torch_app.session().send(q, max_new_tokens=24).result().token_ids for q in questions]

    assert [on_gpu.session().send(q, max_new_tokens=24).result().token_ids for q in questions] == expected


@pytest.mark.parametrize("format", ["fp8", "int4"])
@pytest.mark.parametrize("tokens", [1, 16, 512])
@torch.inference_mode()
def test_the_kernels_at_full_size_read_quantized_experts_as_their_dequantized_weights(full_size, format, tokens):
    from omni_local.kernels.moe.routed_experts import weighted_expert_rows
    from omni_local.model.quantized import QuantizedExperts

    _, module, _ = full_size
    quantized = QuantizedExperts.replacing(module, format)
    hidden = torch.randn((tokens, HIDDEN), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
    logits = tied_free_logits(tokens, seed=tokens)
    weights, chosen = routed(logits)
    reference = quantized(hidden, chosen, weights.float())  # dequantized to float32, transformers' loop

    ours = weighted_expert_rows(hidden.bfloat16(), logits, quantized.gate_up_values, quantized.down_values, TOP_K,
                                renormalize=True, gate_up_scales=quantized.gate_up_scales,
                                down_scales=quantized.down_scales).sum(dim=1).float()

    assert ((ours - reference).norm() / reference.norm()).item() <= 0.01


@torch.inference_mode()
def test_after_the_warm_up_the_experts_compile_no_kernel_at_any_token_count(on_gpu):
    from triton import knobs

    mlp = on_gpu.backend.loaded.model.thinker.model.language_model.layers[0].mlp
    triton = on_gpu.backend.engine.runner.regions.moe
    triton.warm_up(mlp, 600)
    compiled = []
    hook, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, (
        lambda *args, **kwargs: compiled.append(kwargs.get("repr", "a kernel")))
    try:
        # odd and even counts, ones that are multiples of 16 and ones that are not, in every plan
        for tokens in (2, 3, 15, 31, 177, 255, 256, 333, 599):
            triton.routed_experts(mlp, torch.randn((tokens, mlp.gate.weight.shape[1]), device="cuda",
                                                   dtype=mlp.gate.weight.dtype))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert compiled == []
