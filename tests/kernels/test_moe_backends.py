"""The MoE backends on the demo model: `torch` is transformers' own block bit for bit; `triton` (our
kernels, in Triton's interpreter on CPU runs) gives the same blocks within float32 tolerance and the
same greedy replies. (What the setting picks: test_triton_settings.py.)"""

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine.forward.moe import TORCH, mlp_output, moe_backend
from omni_local.kernels.moe import sorting
from omni_local.kernels.moe.expert_weights import kernel_weight
from replies import send

# torch's own float32 tolerance: the kernels sum each expert's 768 or 2,048 products in another order
# than cuBLAS does (on an H200, 2 of 1,472 outputs of a 23-token Thinker block differed by 1.9e-6).
FLOAT32 = dict(rtol=1.3e-6, atol=1e-5)


def moe_blocks(model) -> dict[str, torch.nn.Module]:
    return {"thinker": model.thinker.model.language_model.layers[0].mlp,
            "talker, with its shared expert": model.talker.model.layers[0].mlp}


def hidden_for(mlp: torch.nn.Module, tokens: int) -> torch.Tensor:
    weight = mlp.gate.weight
    generator = torch.Generator().manual_seed(tokens)
    return torch.randn((1, tokens, weight.shape[1]), generator=generator).to(weight.device, weight.dtype)


@pytest.mark.parametrize("block", ["thinker", "talker, with its shared expert"])
@torch.inference_mode()
def test_the_torch_backend_is_transformers_own_moe_block_bit_for_bit(speaking_app, block):
    mlp = moe_blocks(speaking_app.backend.loaded.model)[block]
    hidden = hidden_for(mlp, 9)

    assert torch.equal(mlp_output(mlp, hidden, TORCH), mlp(hidden))


@pytest.mark.parametrize("block", ["thinker", "talker, with its shared expert"])
@pytest.mark.parametrize("tokens", [1, 23])
@torch.inference_mode()
def test_the_triton_backend_gives_the_torch_backends_moe_block(speaking_app, block, tokens):
    mlp = moe_blocks(speaking_app.backend.loaded.model)[block]
    hidden = hidden_for(mlp, tokens)
    triton = moe_backend("triton", hidden.device)

    torch.testing.assert_close(mlp_output(mlp, hidden, triton), mlp_output(mlp, hidden, TORCH), **FLOAT32)


@pytest.fixture
def sorted_in_chunks_of_16(monkeypatch):
    """Every sort by expert in chunks of 16 pairs, whatever the pair count: a 23-token block's 46
    pairs take three chunks."""
    def refused(*args):
        raise AssertionError("sorted in one program")

    monkeypatch.setattr(sorting, "CHUNKED_FROM_PAIRS", 1)
    monkeypatch.setattr(sorting, "CHUNK_PAIRS", 16)
    monkeypatch.setattr(sorting, "sort_in_one_program", refused)


@pytest.mark.parametrize("block", ["thinker", "talker, with its shared expert"])
@torch.inference_mode()
def test_the_triton_backend_sorting_in_chunks_gives_the_torch_backends_moe_block(speaking_app, block,
                                                                                 sorted_in_chunks_of_16):
    mlp = moe_blocks(speaking_app.backend.loaded.model)[block]
    hidden = hidden_for(mlp, 23)
    triton = moe_backend("triton", hidden.device)

    torch.testing.assert_close(mlp_output(mlp, hidden, triton), mlp_output(mlp, hidden, TORCH), **FLOAT32)


def test_greedy_replies_spoken_and_not_with_the_triton_backend_are_the_torch_backends(demo_settings,
                                                                                    demo_checkpoint):
    replies = {}
    for backend in ("torch", "triton"):
        settings = demo_settings.replace(moe_backend=backend, speech=True, max_speech_seconds=1.0)
        with OmniLocal(settings) as app:
            assert app.backend.engine.runner.regions.moe.name == backend
            assert app.backend.engine.speaker.runner.regions.moe.name == backend
            written = app.session().send("What do fishermen sing at night?", max_new_tokens=12).result()
            spoken, frames, _, _ = send(app, app.session(), "Tell me about lighthouses.", voice="Chelsie")
            replies[backend] = written.token_ids, spoken.token_ids, frames
    assert replies["triton"] == replies["torch"]
    assert all(replies["torch"])  # tokens written, tokens spoken, and codec frames


@pytest.mark.parametrize("block", ["thinker", "talker, with its shared expert"])
def test_the_triton_backends_warm_up_runs_every_plan_its_block_takes_up_to_the_longest_forward(
        speaking_app, block, monkeypatch):
    from omni_local.engine.forward.moe import triton_backend
    from omni_local.kernels.moe import routed_experts

    mlp = moe_blocks(speaking_app.backend.loaded.model)[block]
    triton = moe_backend("triton", mlp.gate.weight.device)
    monkeypatch.setattr(triton_backend, "compiles_kernels", lambda device: True)  # the interpreter too, here
    counts = []
    monkeypatch.setattr(routed_experts, "weighted_expert_rows",
                        _recording(routed_experts.weighted_expert_rows, lambda hidden, *_: counts.append(len(hidden))))
    triton.warm_up(mlp, 300)

    def plan(tokens):
        weights = [kernel_weight(mlp.experts.gate_up_proj), kernel_weight(mlp.experts.down_proj)]
        return routed_experts.kernel_plan(tokens, mlp.gate.top_k, *weights, mlp.gate.weight.device)

    assert {plan(tokens) for tokens in counts} == {plan(tokens) for tokens in range(1, 301)}
    assert len(counts) == len({plan(tokens) for tokens in counts}) > 2  # each plan once; sorts in chunks among them


def _recording(function, record):
    def recorded(*args, **kwargs):
        record(*args, **kwargs)
        return function(*args, **kwargs)
    return recorded
