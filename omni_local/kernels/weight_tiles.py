"""How our GEMM kernels (the MoE experts', kernels/moe/; the dense layers', gemv.py) read
a tile of a weight, in each storage format (model/quantized/).

A tile is [BLOCK_K, BLOCK_N]: element (k, n) is W[n, start + k] of a weight W [N, K].
- PLAIN: the weight in the activations' dtype, as loaded.
- ROW_SCALED: fp8 (e4m3) or int8 values, converted to the activations' dtype as they are loaded
  (exactly: both fit in float16's and bfloat16's significands); the row scales [N] multiply the
  finished sums (`row_scales`), since a row's scale is the same for every k.
- INT4_GROUPS: two values a byte along K (the even k in the low nibble, each stored plus 8): a
  tile's bytes are loaded once as [BLOCK_K / 2, BLOCK_N], contiguous along K as a plain tile's
  values are (so the loads are as wide), and split into the even-k and the odd-k values
  (`int4_halves`), which multiply the activations' even and odd columns (`even_odd_columns`): two
  dots of half the depth, the same products as one over the unpacked tile, and no full-precision
  copy. (Loading each k's byte apart, as a [BLOCK_K, BLOCK_N] gather of k // 2, reads every byte
  twice and defeats the wide loads.) A group's scale is the same for every k of a tile (BLOCK_K
  divides the group), so it multiplies the tile's partial sums (`group_scales`), in float32. K is
  whole groups, so no tile passes it: int4 tiles are masked by column only (a mask along K, which
  Triton cannot see is whole, made each byte a load of its own).
"""

import os

import triton
import triton.language as tl


PLAIN: tl.constexpr = tl.constexpr(0)
ROW_SCALED: tl.constexpr = tl.constexpr(1)
INT4_GROUPS: tl.constexpr = tl.constexpr(2)
_FLOAT_2_POW_23_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # 2.0**23 as float32 bits
_2_POW_23_PLUS_8: tl.constexpr = tl.constexpr(8388616.0)
# Compiled, int4 is unpacked by the PTX below; Triton's interpreter (the tests on the CPU) cannot run
# inline assembly and takes the same arithmetic in Triton's operations.
_UNPACK_IN_PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
# Four int4 bytes a 32-bit register ($8) to the float32 bits of their eight values: low nibbles to
# $0-$3, high ones to $4-$7. A nibble v at bits [p, p + 4) of a register, p < 16, is kept in place by
# one lop3, (word & 0xF << p) | the bits of 2**(23 - p), a float32 whose mantissa's bit p is worth 1:
# 2**(23 - p) + v exactly; then less 2**(23 - p) + 8. Bytes 2 and 3 are shifted down to p < 16 first
# (bit 23 is the exponent's). Nine integer operations and eight subtractions for eight values, where
# Triton's code takes a byte out of the register, masks, shifts and ors each nibble apart (about 10
# instructions a byte, measured in the sm_90 code).
_UNPACK_FOUR_BYTES: tl.constexpr = tl.constexpr("""{
.reg .b32 w, t;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;
mov.b32 w, $8;
lop3.b32 t, w, 0x0000000F, 0x4B000000, 0xEA;  mov.b32 f0, t;
lop3.b32 t, w, 0x000000F0, 0x49000000, 0xEA;  mov.b32 f4, t;
lop3.b32 t, w, 0x00000F00, 0x47000000, 0xEA;  mov.b32 f1, t;
lop3.b32 t, w, 0x0000F000, 0x45000000, 0xEA;  mov.b32 f5, t;
shr.u32 w, w, 16;
lop3.b32 t, w, 0x0000000F, 0x4B000000, 0xEA;  mov.b32 f2, t;
lop3.b32 t, w, 0x000000F0, 0x49000000, 0xEA;  mov.b32 f6, t;
lop3.b32 t, w, 0x00000F00, 0x47000000, 0xEA;  mov.b32 f3, t;
lop3.b32 t, w, 0x0000F000, 0x45000000, 0xEA;  mov.b32 f7, t;
sub.f32 f0, f0, 0f4B000008;  sub.f32 f2, f2, 0f4B000008;
sub.f32 f4, f4, 0f49000080;  sub.f32 f6, f6, 0f49000080;
sub.f32 f1, f1, 0f47000800;  sub.f32 f3, f3, 0f47000800;
sub.f32 f5, f5, 0f45008000;  sub.f32 f7, f7, 0f45008000;
mov.b32 $0, f0;  mov.b32 $1, f1;  mov.b32 $2, f2;  mov.b32 $3, f3;
mov.b32 $4, f4;  mov.b32 $5, f5;  mov.b32 $6, f6;  mov.b32 $7, f7;
}""")


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
    low, high = int4_nibbles(packed)
    return low.to(dtype), high.to(dtype)


@triton.jit
def int4_nibbles(packed):
    """The float32 values of int4 bytes `packed` (uint8, any shape): the low nibbles', the high ones'.
    A nibble v as the float32 whose bits are 2**23's with v in the low bits, 2**23 + v exactly, then
    less 2**23 + 8: bit operations and an addition, where converting v (an integer) to a float is
    an instruction NVIDIA GPUs run at a quarter of the rate or less, two a byte."""
    if _UNPACK_IN_PTX:
        low, high = tl.inline_asm_elementwise(_UNPACK_FOUR_BYTES, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
        return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)
    else:
        packed = packed.to(tl.int32)
        low = ((packed & 0xF) | _FLOAT_2_POW_23_BITS).to(tl.float32, bitcast=True) - _2_POW_23_PLUS_8
        high = ((packed >> 4) | _FLOAT_2_POW_23_BITS).to(tl.float32, bitcast=True) - _2_POW_23_PLUS_8
        return low, high


@triton.jit
def even_odd_columns(rows_ptr, rows_mask, depth, start):
    """int4's activations: columns [start, start + BLOCK_K) of the rows whose first columns are at
    `rows_ptr` ([BLOCK_M, 1]; `depth` is arange(BLOCK_K)), as their even and odd columns, each
    [BLOCK_M, BLOCK_K / 2]. One contiguous load, split in registers: loading every other column
    takes a 2-byte load per value."""
    x = tl.load(rows_ptr + start + depth[None, :], mask=rows_mask, other=0.0)
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


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
