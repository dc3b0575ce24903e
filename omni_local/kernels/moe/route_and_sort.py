"""A decode batch's routing and sort by expert in one launch.

A decode step runs routing.py's kernel and sorting.py's one-program sort once a layer each, two
launches of a few microseconds for a handful of tokens (on an H200, 2.2 and 4.5 µs a layer at one
token: 0.32 ms of a bf16 step, 96 of its launches). For up to TOKENS_PER_PROGRAM tokens one program
does both: it routes the tokens as one tile (routing.py's `route_tokens`, the same tile shape, so
the same weights bit for bit), waits for its stores of the chosen experts, and sorts the pairs
(sorting.py's `sort_pairs`, the same rows).
"""

import torch
import triton
import triton.language as tl

from omni_local.kernels.moe.routing import TOKENS_PER_PROGRAM, route_tokens, routing_blocks, routing_outputs
from omni_local.kernels.moe.sorting import CHUNK, sort_pairs, sorted_rows


@triton.jit(do_not_specialize=["tokens", "rows"])
def _route_and_sort_kernel(logits_ptr, weights_ptr, experts_ptr, sorted_ptr, tokens, num_experts, logits_stride,
                           rows, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           CHUNK: tl.constexpr):
    route_tokens(logits_ptr, weights_ptr, experts_ptr, 0, tokens, num_experts, logits_stride, TOP_K, RENORMALIZE,
                 BLOCK_T, BLOCK_E, BLOCK_K)
    # The sort reads the experts this program's threads just stored: all of them, not only its own.
    tl.debug_barrier()
    sort_pairs(experts_ptr, sorted_ptr, tokens * TOP_K, rows, BLOCK_M, BLOCK_E, CHUNK)


def fits_one_program(tokens: int) -> bool:
    return tokens <= TOKENS_PER_PROGRAM


def route_and_sort(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """routing.route's (weights, experts) and sorting.sort_by_expert's pair order, for router logits
    [tokens, experts] of 1 to TOKENS_PER_PROGRAM tokens, in one launch."""
    tokens, num_experts = logits.shape
    assert 0 < tokens and fits_one_program(tokens), tokens
    weights, experts = routing_outputs(logits, top_k)
    rows = sorted_rows(tokens * top_k, num_experts, block_m)
    order = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _route_and_sort_kernel[(1,)](logits, weights, experts, order, tokens, num_experts, logits.stride(0), rows,
                                 TOP_K=top_k, RENORMALIZE=renormalize, **routing_blocks(logits, top_k),
                                 BLOCK_M=block_m, CHUNK=CHUNK, num_warps=4)
    return weights, experts, order
