"""The experts' down projection over the sorted pairs, each row scaled by its routing weight.

One program per (block of BLOCK_M sorted rows, BLOCK_N hidden columns): the block's intermediate
rows times its expert's down projection, times each pair's routing weight, in float32, written at
the pair's own row of a [pairs, hidden] float32 output. Every pair has its own row, so no two
programs write one place: the top-k sum is left to a fixed-order sum over k afterwards (see
routed_experts.py), not to atomics whose order changes from run to run. The weight may be
quantized (kernels/weight_tiles.py), as in gate_up.py."""

import torch
import triton
import triton.language as tl

from omni_local.kernels.moe.sorting import sorted_block
from omni_local.kernels.moe.expert_weights import KernelWeight
from omni_local.kernels.moe.tile_configs import GemmTile
from omni_local.kernels.triton_support import dot_precision
from omni_local.kernels.weight_tiles import (INT4_GROUPS, ROW_SCALED, even_odd_columns, group_scales, int4_tile_dot,
                                             row_scales, weight_tile)


@triton.jit(do_not_specialize=["pairs"])
def _down_kernel(inter_ptr, weight_ptr, scales_ptr, sorted_ptr, experts_ptr, routing_ptr, out_ptr, pairs,
                 hidden_size, intermediate, inter_stride, weight_expert_stride, weight_row_stride,
                 scale_expert_stride, scale_row_stride, out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr, GROUP: tl.constexpr):
    first, expert, pair, real = sorted_block(sorted_ptr, experts_ptr, pairs, BLOCK_M)
    if first >= pairs:
        return  # a block past the last expert's
    tile = tl.program_id(1)
    row = tl.where(real, pair, 0).to(tl.int64)
    columns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < hidden_size
    dtype = inter_ptr.dtype.element_ty
    weight_rows = weight_ptr + expert * weight_expert_stride
    scales = scales_ptr + expert * scale_expert_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FORMAT == INT4_GROUPS:  # K is whole groups, so whole steps: no step passes it, no mask along it
        half = tl.arange(0, BLOCK_K // 2)
        rows_in = inter_ptr + row[:, None] * inter_stride
        for start in range(0, intermediate, BLOCK_K):
            x_even, x_odd = even_odd_columns(rows_in, real[:, None], tl.arange(0, BLOCK_K), start)
            acc += int4_tile_dot(x_even, x_odd, weight_rows, columns, half, start, weight_row_stride, inside[None, :],
                                 DOT_PRECISION) * group_scales(scales, columns, start, scale_row_stride, inside,
                                                               GROUP)[None, :]
    else:
        depth = tl.arange(0, BLOCK_K)
        rows_in = inter_ptr + row[:, None] * inter_stride + depth[None, :]
        for start in range(0, intermediate, BLOCK_K):
            within = start + depth < intermediate
            x = tl.load(rows_in + start, mask=real[:, None] & within[None, :], other=0.0)
            w = weight_tile(weight_rows, columns, depth, start, weight_row_stride, within[:, None] & inside[None, :],
                            dtype)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if FORMAT == ROW_SCALED:
        acc *= row_scales(scales, columns, scale_row_stride, inside)[None, :]
    routing = tl.load(routing_ptr + row, mask=real, other=0.0).to(tl.float32)
    out = out_ptr + row[:, None] * out_stride + columns[None, :]
    tl.store(out, acc * routing[:, None], mask=real[:, None] & inside[None, :])


def weighted_down(intermediate: torch.Tensor, down: KernelWeight, order: torch.Tensor, experts: torch.Tensor,
                  routing: torch.Tensor, block_m: int, tile: GemmTile) -> torch.Tensor:
    """routing weight * (intermediate row W_down^T) [pairs, hidden] float32 for every pair of
    `experts` [tokens, top_k] (weights `routing`, same shape), its `intermediate` [pairs, I] row
    through its expert's `down` [E, hidden, I], over the sorted `order`."""
    pairs, hidden_size = experts.numel(), down.out_features
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=intermediate.device)
    grid = (order.numel() // block_m, triton.cdiv(hidden_size, tile.block_n))
    values = down.values
    _down_kernel[grid](intermediate, values, down.scales, order, experts, routing, out, pairs, hidden_size,
                       down.in_features, intermediate.stride(0), values.stride(0), values.stride(1),
                       *down.scale_strides, out.stride(0), BLOCK_M=block_m, BLOCK_N=tile.block_n,
                       BLOCK_K=down.block_k(tile.block_k), DOT_PRECISION=dot_precision(intermediate.dtype),
                       FORMAT=down.format, GROUP=down.group, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
