"""The experts' gate and up projections over the sorted pairs, SiLU(gate) * up in the epilogue.

One program per (block of BLOCK_M sorted rows, BLOCK_N columns of the intermediate): the block's
tokens times its expert's gate rows and up rows (two dots over the same loaded activations), then
silu(gate) * up in float32, rounded once to the activations' dtype and written at each pair's row
of the [pairs, intermediate] output. The weight may be quantized (kernels/weight_tiles.py): its tiles are
dequantized as they are read, its scales applied to the float32 sums."""

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
def _gate_up_kernel(hidden_ptr, weight_ptr, scales_ptr, sorted_ptr, experts_ptr, out_ptr, pairs, hidden_size,
                    intermediate, hidden_stride, weight_expert_stride, weight_row_stride, scale_expert_stride,
                    scale_row_stride, out_stride, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    FORMAT: tl.constexpr, GROUP: tl.constexpr):
    first, expert, pair, real = sorted_block(sorted_ptr, experts_ptr, pairs, BLOCK_M)
    if first >= pairs:
        return  # a block past the last expert's
    tile = tl.program_id(1)
    token = tl.where(real, pair // TOP_K, 0).to(tl.int64)
    columns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < intermediate
    dtype = hidden_ptr.dtype.element_ty
    gate_rows = weight_ptr + expert * weight_expert_stride
    up_rows = gate_rows + intermediate * weight_row_stride  # the up rows follow the gate rows
    gate_scales = scales_ptr + expert * scale_expert_stride
    up_scales = gate_scales + intermediate * scale_row_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FORMAT == INT4_GROUPS:  # K is whole groups, so whole steps: no step passes it, no mask along it
        half = tl.arange(0, BLOCK_K // 2)
        rows_in = hidden_ptr + token[:, None] * hidden_stride
        for start in range(0, hidden_size, BLOCK_K):
            x_even, x_odd = even_odd_columns(rows_in, real[:, None], tl.arange(0, BLOCK_K), start)
            gate += int4_tile_dot(x_even, x_odd, gate_rows, columns, half, start, weight_row_stride,
                                  inside[None, :], DOT_PRECISION) * group_scales(
                gate_scales, columns, start, scale_row_stride, inside, GROUP)[None, :]
            up += int4_tile_dot(x_even, x_odd, up_rows, columns, half, start, weight_row_stride, inside[None, :],
                                DOT_PRECISION) * group_scales(up_scales, columns, start, scale_row_stride, inside,
                                                              GROUP)[None, :]
    else:
        depth = tl.arange(0, BLOCK_K)
        rows_in = hidden_ptr + token[:, None] * hidden_stride + depth[None, :]
        for start in range(0, hidden_size, BLOCK_K):
            within = start + depth < hidden_size
            x = tl.load(rows_in + start, mask=real[:, None] & within[None, :], other=0.0)
            mask = within[:, None] & inside[None, :]
            gate = tl.dot(x, weight_tile(gate_rows, columns, depth, start, weight_row_stride, mask, dtype), gate,
                          input_precision=DOT_PRECISION)
            up = tl.dot(x, weight_tile(up_rows, columns, depth, start, weight_row_stride, mask, dtype), up,
                        input_precision=DOT_PRECISION)
    if FORMAT == ROW_SCALED:
        gate *= row_scales(gate_scales, columns, scale_row_stride, inside)[None, :]
        up *= row_scales(up_scales, columns, scale_row_stride, inside)[None, :]
    activated = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + pair.to(tl.int64)[:, None] * out_stride + columns[None, :]
    tl.store(out, activated.to(out_ptr.dtype.element_ty), mask=real[:, None] & inside[None, :])


def gate_up_silu(hidden: torch.Tensor, gate_up: KernelWeight, order: torch.Tensor, experts: torch.Tensor,
                 block_m: int, tile: GemmTile) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [pairs, intermediate] for every pair of `experts` [tokens, top_k],
    its token's `hidden` [tokens, hidden] row through its expert's `gate_up` [E, 2I, hidden], over
    the sorted `order`."""
    top_k, pairs = experts.shape[1], experts.numel()
    intermediate = gate_up.out_features // 2
    out = hidden.new_empty((pairs, intermediate))
    grid = (order.numel() // block_m, triton.cdiv(intermediate, tile.block_n))
    values = gate_up.values
    _gate_up_kernel[grid](hidden, values, gate_up.scales, order, experts, out, pairs, hidden.shape[1], intermediate,
                          hidden.stride(0), values.stride(0), values.stride(1), *gate_up.scale_strides,
                          out.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=gate_up.block_k(tile.block_k), DOT_PRECISION=dot_precision(hidden.dtype),
                          FORMAT=gate_up.format, GROUP=gate_up.group, num_warps=tile.num_warps,
                          num_stages=tile.num_stages)
    return out
