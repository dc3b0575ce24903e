"""The experts' down projection over the sorted pairs, each row scaled by its routing weight.

One program per (block of BLOCK_M sorted rows, BLOCK_N hidden columns): the block's intermediate
rows times its expert's down projection, times each pair's routing weight, in float32, written at
the pair's own row of a [pairs, hidden] float32 output. Every pair has its own row, so no two
programs write one place: the top-k sum is left to a fixed-order sum over k afterwards (see
routed_experts.py), not to atomics whose order changes from run to run."""

import torch
import triton
import triton.language as tl

from omni_local.engine.triton_support import dot_precision
from omni_local.engine.moe.kernels.sorting import sorted_block
from omni_local.engine.moe.tile_configs import GemmTile


@triton.jit
def _down_kernel(inter_ptr, weight_ptr, sorted_ptr, experts_ptr, routing_ptr, out_ptr, pairs,
                 hidden_size, intermediate, inter_stride, weight_expert_stride, weight_row_stride,
                 out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    first, expert, pair, real = sorted_block(sorted_ptr, experts_ptr, pairs, BLOCK_M)
    if first >= pairs:
        return  # a block past the last expert's
    tile = tl.program_id(1)
    row = tl.where(real, pair, 0).to(tl.int64)
    columns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < hidden_size
    depth = tl.arange(0, BLOCK_K)
    rows_in = inter_ptr + row[:, None] * inter_stride + depth[None, :]
    # [BLOCK_K, BLOCK_N] view of the expert's down projection [hidden, intermediate]
    weight_in = weight_ptr + expert * weight_expert_stride + columns[None, :] * weight_row_stride + depth[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        within = start + depth < intermediate
        x = tl.load(rows_in + start, mask=real[:, None] & within[None, :], other=0.0)
        w = tl.load(weight_in + start, mask=within[:, None] & inside[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    routing = tl.load(routing_ptr + row, mask=real, other=0.0).to(tl.float32)
    out = out_ptr + row[:, None] * out_stride + columns[None, :]
    tl.store(out, acc * routing[:, None], mask=real[:, None] & inside[None, :])


def weighted_down(intermediate: torch.Tensor, down: torch.Tensor, order: torch.Tensor, experts: torch.Tensor,
                  routing: torch.Tensor, block_m: int, tile: GemmTile) -> torch.Tensor:
    """routing weight * (intermediate row W_down^T) [pairs, hidden] float32 for every pair of
    `experts` [tokens, top_k] (weights `routing`, same shape), its `intermediate` [pairs, I] row
    through its expert's `down` [E, hidden, I], over the sorted `order`."""
    pairs, hidden_size = experts.numel(), down.shape[1]
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=intermediate.device)
    grid = (order.numel() // block_m, triton.cdiv(hidden_size, tile.block_n))
    _down_kernel[grid](intermediate, down, order, experts, routing, out, pairs, hidden_size, down.shape[2],
                       intermediate.stride(0), down.stride(0), down.stride(1), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                       DOT_PRECISION=dot_precision(intermediate.dtype), num_warps=tile.num_warps,
                       num_stages=tile.num_stages)
    return out
