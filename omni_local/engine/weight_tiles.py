"""How our GEMM kernels (the MoE experts', engine/moe/kernels/; the dense layers', engine/dense/) read
a tile of a weight, in each storage format (model/quantized/).

A tile is [BLOCK_K, BLOCK_N]: element (k, n) is W[n, start + k] of a weight W [N, K].
- PLAIN: the weight in the activations' dtype, as loaded.
- ROW_SCALED: fp8 (e4m3) or int8 values, converted to the activations' dtype as they are loaded
  (exactly: both fit in float16's and bfloat16's significands); the row scales [N] multiply the
  finished sums (`row_scales`), since a row's scale is the same for every k.
- INT4_GROUPS: two values a byte along K (the even k in the low nibble, each stored plus 8): each
  element loads its byte and shifts out its nibble, so the bytes come from memory once (the two
  lanes of a byte share its cache line) and no full-precision copy is made. A group's scale is the
  same for every k of a tile (BLOCK_K divides the group), so it multiplies the tile's partial sums
  (`group_scales`), in float32.
"""

import triton
import triton.language as tl


PLAIN: tl.constexpr = tl.constexpr(0)
ROW_SCALED: tl.constexpr = tl.constexpr(1)
INT4_GROUPS: tl.constexpr = tl.constexpr(2)


@triton.jit
def weight_tile(rows_ptr, columns, depth, start, row_stride, mask, dtype, FORMAT: tl.constexpr):
    """The tile at reduction offset `start` of the weight whose row n begins at `rows_ptr + n *
    row_stride` (int4: in bytes); `depth` is arange(BLOCK_K), `columns` the tile's rows of W."""
    k = start + depth
    if FORMAT == INT4_GROUPS:
        packed = tl.load(rows_ptr + columns[None, :] * row_stride + (k // 2)[:, None], mask=mask, other=0)
        nibble = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
        return (nibble - 8).to(dtype)
    return tl.load(rows_ptr + columns[None, :] * row_stride + k[:, None], mask=mask, other=0.0).to(dtype)


@triton.jit
def group_scales(scales_ptr, columns, start, scale_row_stride, inside, GROUP: tl.constexpr):
    """int4: the scales [BLOCK_N] float32 of the group holding reduction offset `start`."""
    return tl.load(scales_ptr + columns * scale_row_stride + start // GROUP, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def row_scales(scales_ptr, columns, scale_row_stride, inside):
    """fp8 or int8: the row scales [BLOCK_N] float32."""
    return tl.load(scales_ptr + columns * scale_row_stride, mask=inside, other=0.0).to(tl.float32)
