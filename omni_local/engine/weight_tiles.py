"""How our GEMM kernels (the MoE experts', engine/moe/kernels/; the dense layers', engine/dense/) read
a tile of a weight, in each storage format (model/quantized/).

A tile is [BLOCK_K, BLOCK_N]: element (k, n) is W[n, start + k] of a weight W [N, K].
- PLAIN: the weight in the activations' dtype, as loaded.
- ROW_SCALED: fp8 (e4m3) or int8 values, converted to the activations' dtype as they are loaded
  (exactly: both fit in float16's and bfloat16's significands); the row scales [N] multiply the
  finished sums (`row_scales`), since a row's scale is the same for every k.
- INT4_GROUPS: two values a byte along K (the even k in the low nibble, each stored plus 8): a
  tile's bytes are loaded once as [BLOCK_K / 2, BLOCK_N], contiguous along K as a plain tile's
  values are (so the loads are as wide), and split into the even-k and the odd-k values
  (`int4_halves`), which multiply the activations' even and odd columns: two dots of half the
  depth, the same products as one over the unpacked tile, and no full-precision copy. (Loading each
  k's byte apart, as a [BLOCK_K, BLOCK_N] gather of k // 2, reads every byte twice and defeats the
  wide loads.) A group's scale is the same for every k of a tile (BLOCK_K divides the group), so it
  multiplies the tile's partial sums (`group_scales`), in float32.
"""

import triton
import triton.language as tl


PLAIN: tl.constexpr = tl.constexpr(0)
ROW_SCALED: tl.constexpr = tl.constexpr(1)
INT4_GROUPS: tl.constexpr = tl.constexpr(2)
_FLOAT_2_POW_23_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # 2.0**23 as float32 bits
_2_POW_23_PLUS_8: tl.constexpr = tl.constexpr(8388616.0)


@triton.jit
def weight_tile(rows_ptr, columns, depth, start, row_stride, mask, dtype):
    """PLAIN or ROW_SCALED: the tile at reduction offset `start` of the weight whose row n begins at
    `rows_ptr + n * row_stride`, in `dtype`; `depth` is arange(BLOCK_K), `columns` the tile's rows of W."""
    k = start + depth
    return tl.load(rows_ptr + columns[None, :] * row_stride + k[:, None], mask=mask, other=0.0).to(dtype)


@triton.jit
def int4_halves(rows_ptr, columns, half, start, row_stride, mask, dtype):
    """INT4_GROUPS: the tile at reduction offset `start` (even) as its even-k and odd-k values, each
    [BLOCK_K / 2, BLOCK_N] in `dtype`, from one load of its bytes; `half` is arange(BLOCK_K / 2), row
    n of the weight begins at byte `rows_ptr + n * row_stride`. Masked bytes read as 0x88: zeros."""
    packed = tl.load(rows_ptr + columns[None, :] * row_stride + (start // 2 + half)[:, None], mask=mask, other=0x88)
    low, high = int4_nibbles(packed.to(tl.int32))
    return low.to(dtype), high.to(dtype)


@triton.jit
def int4_nibbles(packed):
    """The float32 values of int4 bytes `packed` (int32, any shape): the low nibbles', the high ones'.
    A nibble v as the float32 whose bits are 2**23's with v in the low bits, 2**23 + v exactly, then
    less 2**23 + 8: bit operations and an addition, where converting v (an integer) to a float is
    an instruction NVIDIA GPUs run at a quarter of the rate or less, two a byte."""
    low = ((packed & 0xF) | _FLOAT_2_POW_23_BITS).to(tl.float32, bitcast=True) - _2_POW_23_PLUS_8
    high = ((packed >> 4) | _FLOAT_2_POW_23_BITS).to(tl.float32, bitcast=True) - _2_POW_23_PLUS_8
    return low, high


@triton.jit
def int4_tile_dot(x_even, x_odd, rows_ptr, columns, half, start, row_stride, mask, DOT_PRECISION: tl.constexpr):
    """The float32 product [BLOCK_M, BLOCK_N] of the activations' columns [start, start + BLOCK_K)
    (`x_even` and `x_odd` [BLOCK_M, BLOCK_K / 2], their even and odd columns, loaded once by the
    caller for every weight it multiplies them by) and the int4 tile there, unscaled."""
    low, high = int4_halves(rows_ptr, columns, half, start, row_stride, mask, x_even.dtype)
    return tl.dot(x_odd, high, tl.dot(x_even, low, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)


@triton.jit
def group_scales(scales_ptr, columns, start, scale_row_stride, inside, GROUP: tl.constexpr):
    """int4: the scales [BLOCK_N] float32 of the group holding reduction offset `start`."""
    return tl.load(scales_ptr + columns * scale_row_stride + start // GROUP, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def row_scales(scales_ptr, columns, scale_row_stride, inside):
    """fp8 or int8: the row scales [BLOCK_N] float32."""
    return tl.load(scales_ptr + columns * scale_row_stride, mask=inside, other=0.0).to(tl.float32)
