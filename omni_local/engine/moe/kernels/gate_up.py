"""The experts' gate and up projections over the sorted pairs, SiLU(gate) * up in the epilogue.

One program per (block of BLOCK_M sorted rows, BLOCK_N columns of the intermediate): the block's
tokens times its expert's gate rows and up rows (two dots over the same loaded activations), then
silu(gate) * up in float32, rounded once to the activations' dtype and written at each pair's row
of the [pairs, intermediate] output."""

import torch
import triton
import triton.language as tl

from omni_local.engine.moe.kernels.sorting import sorted_block
from omni_local.engine.moe.tile_configs import GemmTile
from omni_local.engine.triton_support import dot_precision


@triton.jit
def _gate_up_kernel(hidden_ptr, weight_ptr, sorted_ptr, experts_ptr, out_ptr, pairs, hidden_size,
                    intermediate, hidden_stride, weight_expert_stride, weight_row_stride, out_stride,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    first, expert, pair, real = sorted_block(sorted_ptr, experts_ptr, pairs, BLOCK_M)
    if first >= pairs:
        return  # a block past the last expert's
    tile = tl.program_id(1)
    token = tl.where(real, pair // TOP_K, 0).to(tl.int64)
    columns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < intermediate
    depth = tl.arange(0, BLOCK_K)
    rows_in = hidden_ptr + token[:, None] * hidden_stride + depth[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's gate rows and its up rows (`intermediate` further on)
    gate_in = weight_ptr + expert * weight_expert_stride + columns[None, :] * weight_row_stride + depth[:, None]
    up_in = gate_in + intermediate * weight_row_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_K):
        within = start + depth < hidden_size
        x = tl.load(rows_in + start, mask=real[:, None] & within[None, :], other=0.0)
        w_gate = tl.load(gate_in + start, mask=within[:, None] & inside[None, :], other=0.0)
        w_up = tl.load(up_in + start, mask=within[:, None] & inside[None, :], other=0.0)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + pair.to(tl.int64)[:, None] * out_stride + columns[None, :]
    tl.store(out, activated.to(out_ptr.dtype.element_ty), mask=real[:, None] & inside[None, :])


def gate_up_silu(hidden: torch.Tensor, gate_up: torch.Tensor, order: torch.Tensor, experts: torch.Tensor,
                 block_m: int, tile: GemmTile) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [pairs, intermediate] for every pair of `experts` [tokens, top_k],
    its token's `hidden` [tokens, hidden] row through its expert's `gate_up` [E, 2I, hidden], over
    the sorted `order`."""
    top_k, pairs = experts.shape[1], experts.numel()
    intermediate = gate_up.shape[1] // 2
    out = hidden.new_empty((pairs, intermediate))
    grid = (order.numel() // block_m, triton.cdiv(intermediate, tile.block_n))
    _gate_up_kernel[grid](hidden, gate_up, order, experts, out, pairs, hidden.shape[1], intermediate,
                          hidden.stride(0), gate_up.stride(0), gate_up.stride(1), out.stride(0),
                          TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                          DOT_PRECISION=dot_precision(hidden.dtype), num_warps=tile.num_warps,
                          num_stages=tile.num_stages)
    return out
