"""A few rows times a weight-only quantized weight: out [M, N] = x [M, K] @ (W * scales)^T.

For a decode batch (M of 1 to 16) through the attention projections: the product is bound by reading
W, so each program reads its BLOCK_N rows of W once, in their stored bytes (fp8 e4m3 or int8, one
scale a row; or int4, two values a byte, one scale per group of inputs), each tile converted to the
rows' dtype as it is loaded (kernels/weight_tiles.py), and multiplies them by its BLOCK_M rows of x
with float32 sums. A row's scale is the same for every k, so it multiplies the finished sums; an
int4 group's multiplies its tile's (BLOCK_K divides the group). The result is rounded once to x's
dtype. A weight in x's own dtype has no scales (`invariant_matmul`, the deterministic setting's
product for any M: engine/forward/batch_invariant.py).

Programs: (N tiles, M blocks, K splits). With one split (the default), a program walks all of K in
BLOCK_K steps and writes out directly. With SPLIT_K splits, split s walks its own run of whole
BLOCK_K steps and writes its float32 sums to partials [SPLIT_K, M, N]; the tile's last split to
finish (kernels/last_arrival.py) adds them in split order, then scales and rounds. A row's reduction
order depends on K and the tile alone (gemv_tiles.py picks the tile from the weight's shape), not on
M, the run, or which split came last.
"""

import torch
import triton
import triton.language as tl

from omni_local.kernels.gemv_tiles import GemvTile, gemv_tile
from omni_local.kernels.last_arrival import arrival_counters, last_to_arrive
from omni_local.kernels.triton_support import dot_precision
from omni_local.kernels.weight_tiles import (INT4_GROUPS, PLAIN, ROW_SCALED, even_odd_columns, group_scales,
                                             int4_tile_dot, row_scales, weight_tile)

# int4's BLOCK_K is at most a group (one scale a tile) and at least 32 (two dots of half of it, and
# tl.dot takes 16 at least): smaller groups are not read here.
MIN_INT4_GROUP = 32


@triton.jit
def _gemv_kernel(x_ptr, weight_ptr, scales_ptr, out_ptr, partials_ptr, counters_ptr, rows, out_features,
                 in_features, split_depth, x_row_stride, weight_row_stride, scale_row_stride, out_row_stride,
                 partial_split_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 FORMAT: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    inside = columns < out_features
    real = row < rows
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # split_depth is whole BLOCK_K steps: a split's last step may pass K, never into the next split.
    first = split * split_depth
    if FORMAT == INT4_GROUPS:  # K is whole groups, so whole steps: no step passes it
        half = tl.arange(0, BLOCK_K // 2)
        rows_in = x_ptr + row.to(tl.int64)[:, None] * x_row_stride
        for start in range(first, tl.minimum(first + split_depth, in_features), BLOCK_K):
            x_even, x_odd = even_odd_columns(rows_in, real[:, None], tl.arange(0, BLOCK_K), start)
            acc += int4_tile_dot(x_even, x_odd, weight_ptr, columns, half, start, weight_row_stride,
                                 inside[None, :], DOT_PRECISION) * group_scales(
                scales_ptr, columns, start, scale_row_stride, inside, GROUP)[None, :]
    else:
        depth = tl.arange(0, BLOCK_K)
        rows_in = x_ptr + row.to(tl.int64)[:, None] * x_row_stride + depth[None, :]
        for start in range(first, tl.minimum(first + split_depth, in_features), BLOCK_K):
            within = start + depth < in_features
            x = tl.load(rows_in + start, mask=real[:, None] & within[None, :], other=0.0)
            w = weight_tile(weight_ptr, columns, depth, start, weight_row_stride, within[:, None] & inside[None, :],
                            dtype)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    written = real[:, None] & inside[None, :]
    if SPLIT_K > 1:
        # Partials [SPLIT_K, M, N]: an empty split writes its zeros. The tile's last split adds them.
        partials = partials_ptr + row[:, None] * out_features + columns[None, :]
        tl.store(partials + split * partial_split_stride, acc, mask=written)
        counter = counters_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if not last_to_arrive(counter, SPLIT_K):
            return
        acc = tl.load(partials, mask=written, other=0.0, cache_modifier=".cg")
        for other in tl.static_range(1, SPLIT_K):
            acc += tl.load(partials + other * partial_split_stride, mask=written, other=0.0, cache_modifier=".cg")
    if FORMAT == ROW_SCALED:
        acc *= row_scales(scales_ptr, columns, 1, inside)[None, :]
    tl.store(out_ptr + row[:, None] * out_row_stride + columns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=written)


def gemv_into(out: torch.Tensor, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None,
              tile: GemvTile, partials: torch.Tensor | None = None) -> torch.Tensor:
    """Writes every element of `out` [M, N] (x's dtype) with x [M, K] times the weight [N, K] of
    `values` and `scales`: fp8 e4m3 or int8 [N, K] with `scales` [N] (float32, or x's dtype); packed
    int4 uint8 [N, K / 2] with `scales` [N, K / group] (model/quantized/formats.py); or `values` in
    x's dtype and `scales` None. With `tile.split_k` > 1, through `partials` [split_k, M, N] float32
    (allocated where None). Returns `out`."""
    rows, in_features = x.shape
    out_features = values.shape[0]
    format, group, block_k = _weight_format(values, scales, x.dtype, in_features, tile.block_k)
    assert values.stride(1) == 1, values.stride()
    assert out.shape == (rows, out_features) and out.stride(1) == 1 and out.dtype == x.dtype, (out.shape, out.dtype)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    steps = triton.cdiv(in_features, block_k)
    split_depth = triton.cdiv(steps, tile.split_k) * block_k
    grid = (triton.cdiv(out_features, tile.block_n), triton.cdiv(rows, tile.block_m), tile.split_k)
    if tile.split_k == 1:
        partials = counters = out  # neither is read
    else:
        if partials is None:
            partials = torch.empty((tile.split_k, rows, out_features), dtype=torch.float32, device=x.device)
        assert partials.shape == (tile.split_k, rows, out_features) and partials.is_contiguous(), partials.shape
        counters = arrival_counters(x.device, grid[0] * grid[1])
    scales = values if scales is None else scales  # never read where there are none
    _gemv_kernel[grid](x, values, scales, out, partials, counters, rows, out_features, in_features, split_depth,
                       x.stride(0), values.stride(0), scales.stride(0), out.stride(0), partials.stride(0),
                       BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, SPLIT_K=tile.split_k,
                       FORMAT=format, GROUP=group, DOT_PRECISION=dot_precision(x.dtype), num_warps=tile.num_warps,
                       num_stages=tile.num_stages)
    return out


def _weight_format(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, in_features: int,
                   block_k: int) -> tuple[int, int, int]:
    """(format, int4 group or 0, BLOCK_K) of a weight as gemv_into takes it."""
    if scales is None:
        assert values.dtype == dtype and values.shape[1] == in_features, (values.dtype, dtype, values.shape)
        return PLAIN.value, 0, block_k
    assert scales.is_contiguous(), scales.stride()
    if values.dtype == torch.uint8:
        group = in_features // scales.shape[1]
        assert 2 * values.shape[1] == in_features and group * scales.shape[1] == in_features, (values.shape, scales.shape)
        if not reads_int4_groups(min(block_k, group)):
            raise ValueError(f"the GEMV reads int4 in groups of {MIN_INT4_GROUP} inputs or more, not {group}")
        return INT4_GROUPS.value, group, min(block_k, group)
    assert values.dtype in (torch.float8_e4m3fn, torch.int8) and values.shape[1] == in_features, values.dtype
    return ROW_SCALED.value, 0, block_k


def reads_int4_groups(group: int) -> bool:
    """Whether the GEMV reads int4 weights in groups of `group` inputs."""
    return group >= MIN_INT4_GROUP


def gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, tile: GemvTile | None = None
         ) -> torch.Tensor:
    """(x [M, K] @ values^T) * scales (scales None: none): [M, N] in x's dtype; `tile` None takes
    gemv_tiles.py's."""
    tile = tile or gemv_tile(values.shape[0], x.shape[1], x.device)
    return gemv_into(x.new_empty((x.shape[0], values.shape[0])), x, values, scales, tile)


@torch.library.custom_op("omni_local::quantized_gemv", mutates_args=())
def quantized_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`gemv` with the shape's tile, as one op: torch.compile leaves it whole inside the compiled
    layers, and a CUDA graph captures its launches."""
    return gemv(x, values, scales)


@quantized_gemv.register_fake
def _(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], values.shape[0]))


@torch.library.custom_op("omni_local::invariant_matmul", mutates_args=())
def invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight^T ([N, K], x's dtype) by the GEMV's kernel with the shape's tile, whatever M:
    each row's sums in the same order however many rows come with it (the deterministic setting)."""
    return gemv(x, weight, None)


@invariant_matmul.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
