"""A decode batch's rows times a weight, each row by programs of its own, without tl.dot.

gemv.py multiplies BLOCK_M rows at once by tensor-core dots: at one row, fifteen of its sixteen are
padding, and every tile of the weight is converted into the dot's operand layout first. On an H200
the Thinker's fp8 qkv and o projections took 12.7 and 11.7 µs a call that way (L2 flushed), under a
terabyte a second where the GPU reads 4.8 (bench.dense_projections, run AF). Here, as the MoE's pair
kernels do (engine/moe/kernels/pairs.py), each thread loads 16 bytes of a weight row at a time and
multiplies them by the row's inputs in its own registers (`row_step_terms`, engine/weight_tiles.py),
a step's loads all in flight together.

Programs: (N tiles, rows, K splits). A row's products are its own program's (or its splits'),
whatever the other rows: the same bits alone and in any batch. With SPLIT_K > 1, each split writes
its float32 sums to partials [SPLIT_K, M, N] and the tile's last split to finish adds them in split
order (engine/last_arrival.py). A row's scale (fp8, int8) multiplies the finished sums; an int4
group's, each slot's.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from omni_local.engine.dense.gemv_tiles import device_name
from omni_local.engine.last_arrival import arrival_counters, last_to_arrive
from omni_local.engine.weight_tiles import INT4_GROUPS, PLAIN, ROW_SCALED, row_scales, row_step_terms, row_steps


@dataclass(frozen=True)
class RowTile:
    """BLOCK_N weight rows a program, up to `most_inputs_a_step` inputs a step (a power of two),
    `num_warps` warps, K split among `split_k` programs."""

    block_n: int = 16
    most_inputs_a_step: int = 512
    num_warps: int = 4
    split_k: int = 1


DEFAULT = RowTile()
# Tuned tiles by (GPU name, N, K): `python -m omni_local.bench.dense_projections --sweep-rows`.
TUNED: dict[tuple[str, int, int], RowTile] = {}


def row_tile(out_features: int, in_features: int, device: torch.device) -> RowTile:
    return TUNED.get((device_name(device), out_features, in_features), DEFAULT)


@triton.jit
def _row_gemv_kernel(x_ptr, weight_ptr, scales_ptr, out_ptr, partials_ptr, counters_ptr, rows, out_features,
                     in_features, split_depth, x_row_stride, weight_row_stride, scale_row_stride, out_row_stride,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                     STEP: tl.constexpr, SLOT: tl.constexpr, SLOTS: tl.constexpr):
    tile = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    columns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = columns < out_features
    x_row = x_ptr + row.to(tl.int64) * x_row_stride
    terms = tl.zeros([SLOTS, BLOCK_N], dtype=tl.float32)
    first = split * split_depth  # whole steps: no step passes K, nor into the next split
    for start in range(first, tl.minimum(first + split_depth, in_features), STEP):
        terms += row_step_terms(x_row, weight_ptr, scales_ptr, columns, inside, start, weight_row_stride,
                                scale_row_stride, FORMAT, GROUP, STEP, SLOT, SLOTS)
    sums = tl.sum(terms, axis=0)
    if SPLIT_K > 1:
        # Partials [SPLIT_K, M, N]: an empty split writes its zeros. The tile's last split adds them.
        partials = partials_ptr + row * out_features + columns
        tl.store(partials + split * rows * out_features, sums, mask=inside)
        if not last_to_arrive(counters_ptr + row * tl.num_programs(0) + tile, SPLIT_K):
            return
        sums = tl.load(partials, mask=inside, other=0.0, cache_modifier=".cg")
        for other in tl.static_range(1, SPLIT_K):
            sums += tl.load(partials + other * rows * out_features, mask=inside, other=0.0, cache_modifier=".cg")
    if FORMAT == ROW_SCALED:
        sums *= row_scales(scales_ptr, columns, 1, inside)
    tl.store(out_ptr + row * out_row_stride + columns, sums.to(out_ptr.dtype.element_ty), mask=inside)


def row_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, tile: RowTile | None = None
             ) -> torch.Tensor:
    """(x [M, K] @ W^T) [M, N] in x's dtype, W [N, K] as `values` and `scales`: fp8 e4m3 or int8 [N, K]
    with `scales` [N]; packed int4 uint8 [N, K / 2] with `scales` [N, K / group] (model/quantized/formats.py);
    or `values` in x's dtype and `scales` None; `tile` None takes the shape's (`row_tile`)."""
    rows, in_features = x.shape
    out_features = values.shape[0]
    tile = tile or row_tile(out_features, in_features, x.device)
    assert values.stride(1) == 1 and (scales is None or scales.is_contiguous()), (values.stride(), scales)
    if scales is None:
        format, group = PLAIN.value, 0
    elif values.dtype == torch.uint8:
        format, group = INT4_GROUPS.value, in_features // scales.shape[1]
    else:
        format, group = ROW_SCALED.value, 0
    out = x.new_empty((rows, out_features))
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    steps = row_steps(format, group, in_features, values.element_size(), tile.most_inputs_a_step)
    split_depth = triton.cdiv(in_features // steps["STEP"], tile.split_k) * steps["STEP"]
    grid = (triton.cdiv(out_features, tile.block_n), rows, tile.split_k)
    if tile.split_k == 1:
        partials = counters = out  # neither is read
    else:
        partials = torch.empty((tile.split_k, rows, out_features), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, grid[0] * grid[1])
    scales = values if scales is None else scales  # never read where there are none
    _row_gemv_kernel[grid](x, values, scales, out, partials, counters, rows, out_features, in_features, split_depth,
                           x.stride(0), values.stride(0), scales.stride(0), out.stride(0), BLOCK_N=tile.block_n,
                           SPLIT_K=tile.split_k, **steps, num_warps=tile.num_warps)
    return out
