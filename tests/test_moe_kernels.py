"""Our MoE kernels against transformers' own router and experts, on tiny shapes, in Triton's CPU
interpreter (conftest.py sets TRITON_INTERPRET=1 on CPU runs; a call takes well under a second
here). The GPU run of the same kernels at full size is tests/test_moe_on_gpu.py."""

import pytest
import torch

from conftest import TEST_DEVICE
from moe_cases import experts, logits_choosing, router_over_logits, text_config

if TEST_DEVICE != "cpu":
    pytest.skip("the interpreter tests run on the CPU run; the GPU run has tests/test_moe_on_gpu.py",
                allow_module_level=True)

from omni_local.engine.moe.kernels.routing import route  # noqa: E402 (after the skip: imports triton)
from omni_local.engine.moe.kernels.sorting import sort_by_expert, sorted_rows  # noqa: E402
from omni_local.engine.moe.routed_experts import weighted_expert_rows  # noqa: E402
from omni_local.engine.moe.tile_configs import GemmTile, TileConfig  # noqa: E402

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


ROUTES = {
    "an expert gets no token": [[0, 1], [1, 0], [2, 1], [0, 2]],  # expert 3 of 4 idle
    "one token routed to its top-k": [[3, 1]],
    "uneven loads, one expert over a block": [[1, 0]] * 18 + [[2, 3], [3, 1]],
}


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


def test_the_default_tiles_serve_a_prefill_of_more_tokens_than_a_block():
    config = text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE)
    module = experts(config, torch.float32)
    hidden = torch.randn((70, HIDDEN), generator=torch.Generator().manual_seed(3))
    logits = torch.randn((70, 4), generator=torch.Generator().manual_seed(4))
    _, weights, chosen = router_over_logits(config)(logits)

    rows = weighted_expert_rows(hidden, logits, module.gate_up_proj, module.down_proj, top_k=2, renormalize=True)

    torch.testing.assert_close(rows.sum(dim=1), module(hidden, chosen, weights), **FLOAT32)
