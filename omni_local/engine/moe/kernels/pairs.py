"""A decode step's int4 experts: one program per (token, k) pair and tile of output columns, no sort.

At one to a few tokens each pair has its expert to itself, and the block kernels (gate_up.py,
down.py) spend a tl.dot of BLOCK_M rows on one real row, their int4 tiles unpacked and moved into
the dot's layout at every step: on the H200, a full-size decode step's int4 experts took 3.0 ms,
against 1.1 ms for the same kernels reading bf16, four times the bytes (bench.profile_decode). Here
a program multiplies its pair's one row by its expert's rows as a GEMV does: each step loads the
packed bytes of several int4 groups at once, splits them into the even-k and odd-k values in float32,
multiplies them by the row's even and odd inputs, sums each group's products, scales them by the
group's scale and adds them up (a group's scale is the same for its whole run of k).

gate_up: SiLU(gate) * up of the pair's token, written at the pair's row of [pairs, intermediate];
down: the routing weight times the pair's intermediate row through its expert's down rows, float32,
at the pair's row of [pairs, hidden] (the top-k sum follows, as after down.py). The sums run in a
different order from the block kernels', so the deterministic setting, whose rows must not depend
on how many tokens a forward holds, keeps those (routed_experts.py).
"""

import torch
import triton
import triton.language as tl

from omni_local.engine.moe.kernels.expert_weights import KernelWeight
from omni_local.engine.weight_tiles import int4_halves

# Untuned first choices (to be timed on the H200): programs enough to fill its 132 SMs at one token
# (8 pairs: 384 gate_up programs, 512 down), each step a few KiB of weight bytes per program.
GATE_UP_BLOCK_N = 16
DOWN_BLOCK_N = 32
MOST_GROUPS_A_STEP = 4
NUM_WARPS = 4


@triton.jit
def _int4_row_products(x_even, x_odd, rows_ptr, scales_ptr, columns, inside, half, start, depth, row_stride,
                       scale_row_stride, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_N] float32: the inputs [start, start + BLOCK_K) of one row (`x_even` and `x_odd`, its
    even and odd ones, float32) times the int4 rows `columns` of a weight there, each group's sum
    scaled by its scale; inputs past `depth` count as zeros."""
    within = start + 2 * half < depth
    low, high = int4_halves(rows_ptr, columns, half, start, row_stride, within[:, None] & inside[None, :],
                            tl.float32)
    products = x_even[:, None] * low + x_odd[:, None] * high  # [BLOCK_K / 2, BLOCK_N]
    by_group = tl.sum(tl.reshape(products, (BLOCK_K // GROUP, GROUP // 2, products.shape[1])), axis=1)
    group = start // GROUP + tl.arange(0, BLOCK_K // GROUP)
    scales = tl.load(scales_ptr + columns[None, :] * scale_row_stride + group[:, None],
                     mask=(group < depth // GROUP)[:, None] & inside[None, :], other=0.0).to(tl.float32)
    return tl.sum(by_group * scales, axis=0)


@triton.jit
def _row_inputs(row_ptr, half, start, depth):
    """A row's even and odd inputs of the step at `start`, float32, zeros past `depth`."""
    even = start + 2 * half
    within = even < depth
    return (tl.load(row_ptr + even, mask=within, other=0.0).to(tl.float32),
            tl.load(row_ptr + even + 1, mask=within, other=0.0).to(tl.float32))


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
    half = tl.arange(0, BLOCK_K // 2)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_K):
        x_even, x_odd = _row_inputs(row, half, start, hidden_size)
        gate += _int4_row_products(x_even, x_odd, gate_rows, gate_scales, columns, inside, half, start, hidden_size,
                                   weight_row_stride, scale_row_stride, BLOCK_K, GROUP)
        up += _int4_row_products(x_even, x_odd, up_rows, up_scales, columns, inside, half, start, hidden_size,
                                 weight_row_stride, scale_row_stride, BLOCK_K, GROUP)
    activated = gate / (1.0 + tl.exp(-gate)) * up
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
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, intermediate, BLOCK_K):
        x_even, x_odd = _row_inputs(row, half, start, intermediate)
        acc += _int4_row_products(x_even, x_odd, weight_rows, scales, columns, inside, half, start, intermediate,
                                  weight_row_stride, scale_row_stride, BLOCK_K, GROUP)
    routing = tl.load(routing_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * out_stride + columns, acc * routing, mask=inside)


def gate_up_silu_by_pair(hidden: torch.Tensor, gate_up: KernelWeight, experts: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) [pairs, intermediate] for every pair of `experts` [tokens, top_k]
    (contiguous), its token's `hidden` [tokens, hidden] row through its expert's int4 `gate_up`."""
    top_k, pairs = experts.shape[1], experts.numel()
    intermediate = gate_up.out_features // 2
    out = hidden.new_empty((pairs, intermediate))
    grid = (pairs, triton.cdiv(intermediate, GATE_UP_BLOCK_N))
    values = gate_up.values
    _gate_up_pairs_kernel[grid](hidden, values, gate_up.scales, experts, out, gate_up.in_features, intermediate,
                                hidden.stride(0), values.stride(0), values.stride(1), *gate_up.scale_strides,
                                out.stride(0), TOP_K=top_k, BLOCK_N=GATE_UP_BLOCK_N,
                                BLOCK_K=_step(gate_up), GROUP=gate_up.group, num_warps=NUM_WARPS)
    return out


def weighted_down_by_pair(intermediate: torch.Tensor, down: KernelWeight, experts: torch.Tensor,
                          routing: torch.Tensor) -> torch.Tensor:
    """routing weight * (intermediate row W_down^T) [pairs, hidden] float32 for every pair of `experts`
    [tokens, top_k] (weights `routing`, same shape, both contiguous), through its expert's int4 `down`."""
    pairs, hidden_size = experts.numel(), down.out_features
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=intermediate.device)
    grid = (pairs, triton.cdiv(hidden_size, DOWN_BLOCK_N))
    values = down.values
    _down_pairs_kernel[grid](intermediate, values, down.scales, experts, routing, out, hidden_size, down.in_features,
                             intermediate.stride(0), values.stride(0), values.stride(1), *down.scale_strides,
                             out.stride(0), BLOCK_N=DOWN_BLOCK_N, BLOCK_K=_step(down), GROUP=down.group,
                             num_warps=NUM_WARPS)
    return out


def _step(weight: KernelWeight) -> int:
    """Inputs a step reads: whole groups, as many as divide the weight's groups evenly (a power of
    two, up to MOST_GROUPS_A_STEP), so no step runs past the weight's last group."""
    groups = weight.in_features // weight.group
    per_step = MOST_GROUPS_A_STEP
    while groups % per_step:
        per_step //= 2
    return per_step * weight.group
