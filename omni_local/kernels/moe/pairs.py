"""A decode step's quantized experts (int4, fp8): one program per (token, k) pair and tile of output
columns, no sort.

At one to a few tokens each pair has its expert to itself, and the block kernels (gate_up.py,
down.py) spend a tl.dot of BLOCK_M rows on one real row, their quantized tiles converted into the
dot's operands at every step: on the H200, a full-size decode step's int4 experts took 3.0 ms that
way, against 1.1 ms for the same kernels reading bf16, four times the bytes (bench.profile_decode),
and fp8's were no faster than bf16's. Here a program multiplies its pair's one row by its expert's
rows as a GEMV does. Its threads each load 16 bytes of a weight row at a time (a slot: 32 int4
values, within one group, or 16 fp8 ones) and sum the slot's products with the row's inputs in
their own registers, then (int4) times the slot's group scale; the slots' sums are added up
elementwise across a step's columns of inputs and summed across the program's threads once, after
the last step (fp8: times the row's scale then). A step's slots are one load, all in flight
together; STEP inputs a step, as its PairTile says.

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

from omni_local.kernels.moe.expert_weights import KernelWeight
from omni_local.kernels.weight_tiles import INT4_GROUPS, ROW_SCALED, int4_nibbles, row_scales

SLOT_BYTES = 16  # a thread's load of a weight row: the widest one instruction makes


@dataclass(frozen=True)
class PairTile:
    """A pair kernel's tile: BLOCK_N output columns a program, up to `most_inputs_a_step` inputs a
    step (a power of two), `num_warps` warps. bench/pair_tiles.py times the choices."""

    block_n: int
    most_inputs_a_step: int
    num_warps: int


# The fastest at one token of the Thinker's full-size experts on an H200 (bench/pair_tiles.py,
# 2026-12-03), per weights format: int4 gate_up 13.0 µs a layer, down 8.8 (int4 unpacked in PTX);
# fp8 gate_up 14.4, down 9.8. The Talker's shape was not timed.
GATE_UP_TILES = {"int4": PairTile(block_n=16, most_inputs_a_step=512, num_warps=4),
                 "fp8": PairTile(block_n=8, most_inputs_a_step=512, num_warps=8)}
DOWN_TILES = {"int4": PairTile(block_n=8, most_inputs_a_step=512, num_warps=2),
              "fp8": PairTile(block_n=8, most_inputs_a_step=256, num_warps=2)}


@triton.jit
def _step_terms(row_ptr, rows_ptr, scales_ptr, columns, inside, start, row_stride, scale_row_stride,
                FORMAT: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr, SLOT: tl.constexpr,
                SLOTS: tl.constexpr):
    """[slots, BLOCK_N] float32: the products of inputs [start, start + STEP) of a row and the weight
    rows `columns` there, each slot's (SLOT bytes of a row) summed (int4: times its group's scale),
    not yet summed over the slots."""
    slot = tl.arange(0, SLOTS)
    byte = tl.arange(0, SLOT)
    x = tl.load(row_ptr + start + tl.arange(0, STEP)).to(tl.float32)  # the step's inputs, one load
    if FORMAT == INT4_GROUPS:
        offsets = start // 2 + slot[:, None, None] * SLOT + byte[None, :, None]
        packed = tl.load(rows_ptr + columns[None, None, :] * row_stride + offsets, mask=inside[None, None, :],
                         other=0x88)
        low, high = int4_nibbles(packed)
        x_even, x_odd = tl.split(tl.reshape(x, (SLOTS, SLOT, 2)))  # each byte's two inputs
        sums = tl.sum(x_even[:, :, None] * low + x_odd[:, :, None] * high, axis=1)
        groups = (start + slot * 2 * SLOT) // GROUP
        scales = tl.load(scales_ptr + columns[None, :] * scale_row_stride + groups[:, None], mask=inside[None, :],
                         other=0.0)
        return sums * scales.to(tl.float32)
    else:
        offsets = start + slot[:, None, None] * SLOT + byte[None, :, None]
        values = tl.load(rows_ptr + columns[None, None, :] * row_stride + offsets, mask=inside[None, None, :],
                         other=0.0).to(tl.float32)
        return tl.sum(tl.reshape(x, (SLOTS, SLOT))[:, :, None] * values, axis=1)


@triton.jit
def _finished(terms, scales_ptr, columns, scale_row_stride, inside, FORMAT: tl.constexpr):
    """[BLOCK_N] float32: the row's sums, from its steps' `terms` (fp8: times each row's scale)."""
    sums = tl.sum(terms, axis=0)
    if FORMAT == ROW_SCALED:
        sums *= row_scales(scales_ptr, columns, scale_row_stride, inside)
    return sums


@triton.jit
def _gate_up_pairs_kernel(hidden_ptr, weight_ptr, scales_ptr, experts_ptr, out_ptr, hidden_size, intermediate,
                          hidden_stride, weight_expert_stride, weight_row_stride, scale_expert_stride,
                          scale_row_stride, out_stride, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          FORMAT: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr, SLOT: tl.constexpr,
                          SLOTS: tl.constexpr):
    pair = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < intermediate
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = hidden_ptr + (pair // TOP_K).to(tl.int64) * hidden_stride
    gate_rows = weight_ptr + expert * weight_expert_stride
    up_rows = gate_rows + intermediate * weight_row_stride  # the up rows follow the gate rows
    gate_scales = scales_ptr + expert * scale_expert_stride
    up_scales = gate_scales + intermediate * scale_row_stride
    gate_terms = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
    up_terms = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden_size, STEP):  # gate's and up's loads of a step in flight together
        gate_terms += _step_terms(row, gate_rows, gate_scales, columns, inside, start, weight_row_stride,
                                  scale_row_stride, FORMAT, GROUP, STEP, SLOT, SLOTS)
        up_terms += _step_terms(row, up_rows, up_scales, columns, inside, start, weight_row_stride,
                                scale_row_stride, FORMAT, GROUP, STEP, SLOT, SLOTS)
    gate = _finished(gate_terms, gate_scales, columns, scale_row_stride, inside, FORMAT)
    activated = gate / (1.0 + tl.exp(-gate)) * _finished(up_terms, up_scales, columns, scale_row_stride, inside,
                                                         FORMAT)
    tl.store(out_ptr + pair.to(tl.int64) * out_stride + columns, activated.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _down_pairs_kernel(inter_ptr, weight_ptr, scales_ptr, experts_ptr, routing_ptr, out_ptr, hidden_size,
                       intermediate, inter_stride, weight_expert_stride, weight_row_stride, scale_expert_stride,
                       scale_row_stride, out_stride, BLOCK_N: tl.constexpr, FORMAT: tl.constexpr,
                       GROUP: tl.constexpr, STEP: tl.constexpr, SLOT: tl.constexpr, SLOTS: tl.constexpr):
    pair = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < hidden_size
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = inter_ptr + pair.to(tl.int64) * inter_stride
    weight_rows = weight_ptr + expert * weight_expert_stride
    scales = scales_ptr + expert * scale_expert_stride
    terms = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
    for start in range(0, intermediate, STEP):
        terms += _step_terms(row, weight_rows, scales, columns, inside, start, weight_row_stride, scale_row_stride,
                             FORMAT, GROUP, STEP, SLOT, SLOTS)
    routing = tl.load(routing_ptr + pair).to(tl.float32)
    sums = _finished(terms, scales, columns, scale_row_stride, inside, FORMAT)
    tl.store(out_ptr + pair.to(tl.int64) * out_stride + columns, sums * routing, mask=inside)


def gate_up_silu_by_pair(hidden: torch.Tensor, gate_up: KernelWeight, experts: torch.Tensor,
                         tile: PairTile | None = None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [pairs, intermediate] for every pair of `experts` [tokens, top_k]
    (contiguous), its token's `hidden` [tokens, hidden] row through its expert's quantized `gate_up`."""
    top_k, pairs = experts.shape[1], experts.numel()
    intermediate = gate_up.out_features // 2
    out = hidden.new_empty((pairs, intermediate))
    tile = tile or GATE_UP_TILES[gate_up.quantized]
    grid = (pairs, triton.cdiv(intermediate, tile.block_n))
    values = gate_up.values
    _gate_up_pairs_kernel[grid](hidden, values, gate_up.scales, experts, out, gate_up.in_features, intermediate,
                                hidden.stride(0), values.stride(0), values.stride(1), *gate_up.scale_strides,
                                out.stride(0), TOP_K=top_k, BLOCK_N=tile.block_n, **_steps(gate_up, tile),
                                num_warps=tile.num_warps)
    return out


def weighted_down_by_pair(intermediate: torch.Tensor, down: KernelWeight, experts: torch.Tensor,
                          routing: torch.Tensor, tile: PairTile | None = None) -> torch.Tensor:
    """routing weight * (intermediate row W_down^T) [pairs, hidden] float32 for every pair of `experts`
    [tokens, top_k] (weights `routing`, same shape, both contiguous), through its expert's quantized
    `down`."""
    pairs, hidden_size = experts.numel(), down.out_features
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=intermediate.device)
    tile = tile or DOWN_TILES[down.quantized]
    grid = (pairs, triton.cdiv(hidden_size, tile.block_n))
    values = down.values
    _down_pairs_kernel[grid](intermediate, values, down.scales, experts, routing, out, hidden_size, down.in_features,
                             intermediate.stride(0), values.stride(0), values.stride(1), *down.scale_strides,
                             out.stride(0), BLOCK_N=tile.block_n, **_steps(down, tile), num_warps=tile.num_warps)
    return out


def _steps(weight: KernelWeight, tile: PairTile) -> dict[str, int]:
    """The kernels' format and step constants: inputs a step reads (STEP: the largest power of two up
    to the tile's that divides the weight's inputs, so no step runs past them), bytes a slot (SLOT:
    16, or an int4 group's bytes where that is fewer) and slots a step (SLOTS)."""
    int4 = weight.format == INT4_GROUPS.value
    slot = min(SLOT_BYTES, weight.group // 2) if int4 else SLOT_BYTES
    slot_inputs = 2 * slot if int4 else slot
    step = tile.most_inputs_a_step
    while weight.in_features % step:
        step //= 2
    assert step >= slot_inputs, (weight.in_features, slot_inputs)
    return dict(FORMAT=weight.format, GROUP=weight.group, STEP=step, SLOT=slot, SLOTS=step // slot_inputs)
