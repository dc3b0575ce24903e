"""A decode step's int4 experts: one program per (token, k) pair and tile of output columns, no sort.

At one to a few tokens each pair has its expert to itself, and the block kernels (gate_up.py,
down.py) spend a tl.dot of BLOCK_M rows on one real row, their int4 tiles unpacked into the dot's
operands at every step: on the H200, a full-size decode step's int4 experts took 3.0 ms, against
1.1 ms for the same kernels reading bf16, four times the bytes (bench.profile_decode; why, per
instruction, was not profiled: the unpacking and the dot's layout are the likely cost). Here
a program multiplies its pair's one row by its expert's rows as a GEMV does: for each int4 group it
loads the packed bytes, splits them into the even-k and odd-k values in float32, multiplies them by
the row's even and odd inputs, times the group's scale (the same for its whole run of k), and adds
the products to its threads' terms, which it sums once, after the last group. A step's groups (as
many as its PairTile says) are unrolled, so their loads are in flight together.

gate_up: SiLU(gate) * up of the pair's token, written at the pair's row of [pairs, intermediate];
down: the routing weight times the pair's intermediate row through its expert's down rows, float32,
at the pair's row of [pairs, hidden] (the top-k sum follows, as after down.py). The sums run in a
different order from the block kernels', so the deterministic setting, whose rows must not depend
on how many tokens a forward holds, keeps those (routed_experts.py).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from omni_local.engine.moe.kernels.expert_weights import KernelWeight
from omni_local.engine.weight_tiles import int4_halves


@dataclass(frozen=True)
class PairTile:
    """A pair kernel's tile: BLOCK_N output columns a program, up to `most_groups_a_step` int4
    groups a step (unrolled), `num_warps` warps. bench/pair_tiles.py times the choices."""

    block_n: int
    most_groups_a_step: int
    num_warps: int


# The fastest at one token of the Thinker's full-size int4 experts on an H200 (bench/pair_tiles.py,
# 2026-12-03): gate_up 14.6 µs a layer, down 10.4. The Talker's shape was not timed.
GATE_UP_TILE = PairTile(block_n=16, most_groups_a_step=8, num_warps=8)
DOWN_TILE = PairTile(block_n=32, most_groups_a_step=1, num_warps=8)


@triton.jit
def _int4_group_terms(row_ptr, rows_ptr, scales_ptr, columns, inside, start, row_stride, scale_row_stride,
                      GROUP: tl.constexpr):
    """[GROUP / 2, BLOCK_N] float32: one int4 group's products of inputs [start, start + GROUP) of a
    row and the weight rows `columns` there, dequantized (times the group's scale), not yet summed
    over the group: the caller adds the groups up elementwise and sums across the threads once, at
    the end, so no group waits for a reduction across the program's threads."""
    half = tl.arange(0, GROUP // 2)
    # the group's inputs in one contiguous load, then split (two loads of every other input were
    # one instruction per value)
    x = tl.load(row_ptr + start + tl.arange(0, GROUP)).to(tl.float32)
    x_even, x_odd = tl.split(tl.reshape(x, (GROUP // 2, 2)))
    low, high = int4_halves(rows_ptr, columns, half, start, row_stride, inside[None, :], tl.float32)
    scale = tl.load(scales_ptr + columns * scale_row_stride + start // GROUP, mask=inside, other=0.0)
    return (x_even[:, None] * low + x_odd[:, None] * high) * scale.to(tl.float32)[None, :]


@triton.jit
def _gate_up_pairs_kernel(hidden_ptr, weight_ptr, scales_ptr, experts_ptr, out_ptr, hidden_size, intermediate,
                          hidden_stride, weight_expert_stride, weight_row_stride, scale_expert_stride,
                          scale_row_stride, out_stride, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pair = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < intermediate
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = hidden_ptr + (pair // TOP_K).to(tl.int64) * hidden_stride
    gate_rows = weight_ptr + expert * weight_expert_stride
    up_rows = gate_rows + intermediate * weight_row_stride  # the up rows follow the gate rows
    gate_scales = scales_ptr + expert * scale_expert_stride
    up_scales = gate_scales + intermediate * scale_row_stride
    gate_terms = tl.zeros([GROUP // 2, BLOCK_N], dtype=tl.float32)
    up_terms = tl.zeros([GROUP // 2, BLOCK_N], dtype=tl.float32)
    for step in range(0, hidden_size, BLOCK_K):
        for group in tl.static_range(BLOCK_K // GROUP):  # unrolled: the groups' loads all in flight
            start = step + group * GROUP
            gate_terms += _int4_group_terms(row, gate_rows, gate_scales, columns, inside, start, weight_row_stride,
                                            scale_row_stride, GROUP)
            up_terms += _int4_group_terms(row, up_rows, up_scales, columns, inside, start, weight_row_stride,
                                          scale_row_stride, GROUP)
    gate = tl.sum(gate_terms, axis=0)
    activated = gate / (1.0 + tl.exp(-gate)) * tl.sum(up_terms, axis=0)
    tl.store(out_ptr + pair.to(tl.int64) * out_stride + columns, activated.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _down_pairs_kernel(inter_ptr, weight_ptr, scales_ptr, experts_ptr, routing_ptr, out_ptr, hidden_size,
                       intermediate, inter_stride, weight_expert_stride, weight_row_stride, scale_expert_stride,
                       scale_row_stride, out_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr):
    pair = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < hidden_size
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = inter_ptr + pair.to(tl.int64) * inter_stride
    weight_rows = weight_ptr + expert * weight_expert_stride
    scales = scales_ptr + expert * scale_expert_stride
    terms = tl.zeros([GROUP // 2, BLOCK_N], dtype=tl.float32)
    for step in range(0, intermediate, BLOCK_K):
        for group in tl.static_range(BLOCK_K // GROUP):  # unrolled: the groups' loads all in flight
            terms += _int4_group_terms(row, weight_rows, scales, columns, inside, step + group * GROUP,
                                       weight_row_stride, scale_row_stride, GROUP)
    routing = tl.load(routing_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * out_stride + columns, tl.sum(terms, axis=0) * routing, mask=inside)


def gate_up_silu_by_pair(hidden: torch.Tensor, gate_up: KernelWeight, experts: torch.Tensor,
                         tile: PairTile | None = None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [pairs, intermediate] for every pair of `experts` [tokens, top_k]
    (contiguous), its token's `hidden` [tokens, hidden] row through its expert's int4 `gate_up`."""
    top_k, pairs = experts.shape[1], experts.numel()
    intermediate = gate_up.out_features // 2
    out = hidden.new_empty((pairs, intermediate))
    tile = tile or GATE_UP_TILE
    grid = (pairs, triton.cdiv(intermediate, tile.block_n))
    values = gate_up.values
    _gate_up_pairs_kernel[grid](hidden, values, gate_up.scales, experts, out, gate_up.in_features, intermediate,
                                hidden.stride(0), values.stride(0), values.stride(1), *gate_up.scale_strides,
                                out.stride(0), TOP_K=top_k, BLOCK_N=tile.block_n,
                                BLOCK_K=_step(gate_up, tile), GROUP=gate_up.group, num_warps=tile.num_warps)
    return out


def weighted_down_by_pair(intermediate: torch.Tensor, down: KernelWeight, experts: torch.Tensor,
                          routing: torch.Tensor, tile: PairTile | None = None) -> torch.Tensor:
    """routing weight * (intermediate row W_down^T) [pairs, hidden] float32 for every pair of `experts`
    [tokens, top_k] (weights `routing`, same shape, both contiguous), through its expert's int4 `down`."""
    pairs, hidden_size = experts.numel(), down.out_features
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=intermediate.device)
    tile = tile or DOWN_TILE
    grid = (pairs, triton.cdiv(hidden_size, tile.block_n))
    values = down.values
    _down_pairs_kernel[grid](intermediate, values, down.scales, experts, routing, out, hidden_size, down.in_features,
                             intermediate.stride(0), values.stride(0), values.stride(1), *down.scale_strides,
                             out.stride(0), BLOCK_N=tile.block_n, BLOCK_K=_step(down, tile), GROUP=down.group,
                             num_warps=tile.num_warps)
    return out


def _step(weight: KernelWeight, tile: PairTile) -> int:
    """Inputs a step reads: whole groups, as many as divide the weight's groups evenly (a power of
    two, up to the tile's most a step), so no step runs past the weight's last group."""
    groups = weight.in_features // weight.group
    per_step = tile.most_groups_a_step
    while groups % per_step:
        per_step //= 2
    return per_step * weight.group
