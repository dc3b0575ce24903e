"""Our MoE kernels against transformers' own router and experts, on tiny shapes, in Triton's CPU
interpreter (conftest.py sets TRITON_INTERPRET=1 on CPU runs; a call takes well under a second
here). The GPU run of the same kernels at full size is tests/kernels/test_moe_on_gpu.py."""

import pytest
import torch

from compile_for_h200 import compile_for_h200
from device_under_test import TEST_DEVICE
from moe_cases import ROUTES, experts, logits_choosing, router_over_logits, text_config

if TEST_DEVICE != "cpu":
    pytest.skip("the interpreter tests run on the CPU run; the GPU run has tests/kernels/test_moe_on_gpu.py",
                allow_module_level=True)

from omni_local.kernels.moe.route_and_sort import route_and_sort  # noqa: E402 (after the skip: imports triton)
from omni_local.kernels.moe.routing import route  # noqa: E402
from omni_local.kernels.moe.sorting import (  # noqa: E402
    CHUNK_PAIRS,
    CHUNKED_FROM_PAIRS,
    sort_by_expert,
    sort_in_chunks,
    sort_in_one_program,
    sorted_rows,
)
from omni_local.kernels.moe.routed_experts import weighted_expert_rows  # noqa: E402
from omni_local.kernels.moe.tile_configs import GemmTile, TileConfig  # noqa: E402

# Tiles of 16, the smallest tl.dot takes, over a hidden size and an intermediate size that are not
# multiples of them: several tiles each way, with ragged edges.
SMALL_TILES = TileConfig(16, GemmTile(16, 16), GemmTile(16, 16))
HIDDEN, INTERMEDIATE = 40, 24
FLOAT32 = dict(rtol=1e-5, atol=1e-6)
FLOAT16 = dict(rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routing_kernel_picks_the_routers_experts_and_weights(renormalize):
    config = text_config(num_experts=128, top_k=8, hidden=HIDDEN, intermediate=INTERMEDIATE, renormalize=renormalize)
    logits = torch.randn((5, 128), generator=torch.Generator().manual_seed(1)) * 3
    _, expected_weights, expected_experts = router_over_logits(config)(logits)

    weights, chosen = route(logits, top_k=8, renormalize=renormalize)

    assert torch.equal(chosen.long(), expected_experts)
    torch.testing.assert_close(weights, expected_weights, **FLOAT32)


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_a_decode_batchs_routing_and_sort_in_one_launch_are_the_two_kernels_bit_for_bit(tokens, renormalize):
    logits = torch.randn((tokens, 128), generator=torch.Generator().manual_seed(tokens)) * 3
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the lower index first, either way

    weights, experts, order = route_and_sort(logits, top_k=8, renormalize=renormalize, block_m=16)

    expected_weights, expected_experts = route(logits, top_k=8, renormalize=renormalize)
    assert torch.equal(experts, expected_experts) and experts[0, :2].tolist() == [7, 9]
    assert torch.equal(weights, expected_weights)
    assert torch.equal(order, sort_in_one_program(expected_experts, num_experts=128, block_m=16))


def test_the_sort_puts_each_experts_pairs_in_order_in_whole_blocks_and_pads_with_the_pair_count():
    # 6 experts: expert 0 takes 17 pairs (two blocks), 3 takes one, 4 none, the rest a few.
    routes = [[0, 1]] * 9 + [[0, 2]] * 8 + [[5, 3]] + [[1, 5]] * 2
    chosen = torch.tensor(routes, dtype=torch.int32)
    flat = chosen.flatten()

    order = sort_by_expert(chosen, num_experts=6, block_m=16)

    assert order.numel() == sorted_rows(flat.numel(), 6, 16)
    padding = flat.numel()
    blocks = order.view(-1, 16).tolist()
    seen = []
    for block in blocks:
        real = [p for p in block if p != padding]
        assert real == block[: len(real)]  # padding only at a block's end
        assert len({int(flat[p]) for p in real}) <= 1  # one expert a block
        seen += real
    assert sorted(seen) == list(range(flat.numel()))  # every pair once
    by_expert = [p for e in range(6) for p in range(flat.numel()) if flat[p] == e]
    assert seen == by_expert  # experts in order, each one's pairs in pair order


def skewed_routes(tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """[tokens, top_k] int32 distinct experts a token, the low-numbered ones far more often than the
    high-numbered (some of which get no pair)."""
    noise = torch.randn((tokens, num_experts), generator=torch.Generator().manual_seed(tokens))
    return (noise + torch.linspace(3, -3, num_experts)).topk(top_k, dim=1).indices.to(torch.int32)


# (experts [tokens, top_k], num_experts); pair counts against the default chunk of 256 pairs.
SORT_ROUTES = {
    "uneven loads over 128 experts at top-8, some idle, 3 chunks and a part": (skewed_routes(100, 128, 8), 128),
    "exactly two chunks": (skewed_routes(64, 16, 8), 16),
    "fewer pairs than a chunk": (skewed_routes(5, 8, 2), 8),
    "all pairs on one expert": (torch.full((600, 1), 2, dtype=torch.int32), 4),
    "an expert with no pair, 6 experts": (torch.tensor([[0, 5], [3, 1], [5, 0], [2, 1]] * 70, dtype=torch.int32), 6),
}


@pytest.mark.parametrize("chunk_pairs", [16, CHUNK_PAIRS], ids=["chunks of 16", "the default chunks"])
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("case", SORT_ROUTES)
def test_the_sort_in_chunks_gives_the_one_program_sorts_rows_exactly(case, block_m, chunk_pairs):
    chosen, num_experts = SORT_ROUTES[case]

    chunked = sort_in_chunks(chosen, num_experts, block_m, chunk_pairs)

    assert torch.equal(chunked, sort_in_one_program(chosen, num_experts, block_m))


def test_the_sort_cases_have_the_loads_they_say():
    counts = {case: torch.bincount(chosen.flatten().long(), minlength=experts) for case, (chosen, experts)
              in SORT_ROUTES.items()}
    assert (counts["uneven loads over 128 experts at top-8, some idle, 3 chunks and a part"] == 0).any()
    assert counts["uneven loads over 128 experts at top-8, some idle, 3 chunks and a part"].max() > 32  # a block of 32
    assert counts["an expert with no pair, 6 experts"][4] == 0
    assert [len(chosen.flatten()) for chosen, _ in SORT_ROUTES.values()] == [800, 512, 10, 600, 560]


# The routing and sort kernels at the Thinker's 128 experts, for a decode batch's BLOCK_M and a prefill's.
COMPILE_SORT_FOR_SM90 = """
from omni_local.kernels.moe.sorting import (CHUNK, CHUNK_PAIRS, CHUNK_ROWS, _count_kernel, _offsets_kernel,
                                            _scatter_kernel, _sort_kernel)
from omni_local.kernels.moe.route_and_sort import _route_and_sort_kernel
from omni_local.kernels.moe.routing import TOKENS_PER_PROGRAM, _route_kernel

for block_m in (16, 64):
    compiled(_sort_kernel, dict(experts_ptr="*i32", sorted_ptr="*i32"), dict(BLOCK_M=block_m, BLOCK_E=128, CHUNK=CHUNK),
             num_warps=4)
    compiled(_offsets_kernel, dict(counts_ptr="*i32", offsets_ptr="*i32"),
             dict(BLOCK_M=block_m, BLOCK_E=128, CHUNK_ROWS=CHUNK_ROWS), num_warps=4)
routing = dict(TOP_K=8, RENORMALIZE=True, BLOCK_T=TOKENS_PER_PROGRAM, BLOCK_E=128, BLOCK_K=8)
compiled(_route_kernel, dict(logits_ptr="*bf16", weights_ptr="*bf16", experts_ptr="*i32"), routing, num_warps=4)
compiled(_route_and_sort_kernel, dict(logits_ptr="*bf16", weights_ptr="*bf16", experts_ptr="*i32", sorted_ptr="*i32"),
         dict(routing, BLOCK_M=16, CHUNK=CHUNK), num_warps=4)
chunks = dict(BLOCK_E=128, CHUNK=CHUNK, CHUNK_PAIRS=CHUNK_PAIRS)
compiled(_count_kernel, dict(experts_ptr="*i32", sorted_ptr="*i32", counts_ptr="*i32"), chunks, num_warps=4)
compiled(_scatter_kernel, dict(experts_ptr="*i32", sorted_ptr="*i32", offsets_ptr="*i32"), chunks, num_warps=4)
"""


def test_the_routing_and_sort_kernels_compile_for_an_h200_without_a_gpu():
    done = compile_for_h200(COMPILE_SORT_FOR_SM90)

    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", ROUTES)
def test_the_expert_kernels_give_transformers_experts_output(case, dtype):
    config = text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE)
    module = experts(config, dtype)
    logits = logits_choosing(ROUTES[case], num_experts=4)
    hidden = torch.randn((len(logits), HIDDEN), generator=torch.Generator().manual_seed(2)).to(dtype)
    _, weights, chosen = router_over_logits(config)(logits)
    assert chosen.tolist() == ROUTES[case]
    expected = module(hidden, chosen, weights.to(dtype))

    rows = weighted_expert_rows(hidden, logits.to(dtype), module.gate_up_proj, module.down_proj, top_k=2,
                                renormalize=True, config=SMALL_TILES)

    torch.testing.assert_close(rows.sum(dim=1).to(dtype), expected, **(FLOAT32 if dtype == torch.float32 else FLOAT16))


# 70 tokens: more than a block, sorted in one program; 300: pairs enough for the sort in chunks.
@pytest.mark.parametrize("tokens", [70, 300])
def test_the_default_tiles_serve_a_prefill_of_more_tokens_than_a_block(tokens):
    assert (tokens * 2 >= CHUNKED_FROM_PAIRS) == (tokens == 300)
    config = text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE)
    module = experts(config, torch.float32)
    hidden = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(3))
    logits = torch.randn((tokens, 4), generator=torch.Generator().manual_seed(4))
    _, weights, chosen = router_over_logits(config)(logits)

    rows = weighted_expert_rows(hidden, logits, module.gate_up_proj, module.down_proj, top_k=2, renormalize=True)

    torch.testing.assert_close(rows.sum(dim=1), module(hidden, chosen, weights), **FLOAT32)
