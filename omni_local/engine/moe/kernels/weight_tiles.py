"""How the expert GEMMs read a tile of an expert's weight, in each storage format (model/quantized/).

A tile is [BLOCK_K, BLOCK_N]: element (k, n) is W[n, start + k] of the expert's W [N, K].
- PLAIN: the weight in the activations' dtype, as loaded.
- FP8_ROWS: float8 values, converted to the activations' dtype; the row scales [N] multiply the
  finished sums (`row_scales`), since a row's scale is the same for every k.
- INT4_GROUPS: two values a byte along K (the even k in the low nibble, each stored plus 8): each
  element loads its byte and shifts out its nibble, so the bytes come from memory once (the two
  lanes of a byte share its cache line) and no full-precision copy is made. A group's scale is the
  same for every k of a tile (BLOCK_K divides the group), so it multiplies the tile's partial sums
  (`group_scales`), in float32.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


PLAIN: tl.constexpr = tl.constexpr(0)
FP8_ROWS: tl.constexpr = tl.constexpr(1)
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
    """fp8: the row scales [BLOCK_N] float32."""
    return tl.load(scales_ptr + columns * scale_row_stride, mask=inside, other=0.0).to(tl.float32)


@dataclass(frozen=True)
class KernelWeight:
    """An expert weight [E, N, K] as the GEMM kernels take it: its values, its scales (the values
    again where there are none: never read), their strides, and the format's constants."""

    values: torch.Tensor
    scales: torch.Tensor
    format: int
    group: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.values.shape[1]

    @property
    def scale_strides(self) -> tuple[int, int]:
        return (0, 0) if self.format == PLAIN.value else (self.scales.stride(0), self.scales.stride(1))

    def block_k(self, tile_block_k: int) -> int:
        """The tile's BLOCK_K, at most an int4 group (so one scale covers a tile's k)."""
        return min(tile_block_k, self.group) if self.format == INT4_GROUPS.value else tile_block_k


def kernel_weight(values: torch.Tensor, scales: torch.Tensor | None = None) -> KernelWeight:
    """An expert weight for the GEMM kernels: `values` [E, N, K] in the activations' dtype with no
    `scales`, or quantized (model/quantized/formats.py), its format told by the values' dtype."""
    if scales is None:
        return KernelWeight(values, values, PLAIN.value, 0, values.shape[2])
    if values.dtype == torch.float8_e4m3fn:
        return KernelWeight(values, scales, FP8_ROWS.value, 0, values.shape[2])
    if values.dtype == torch.uint8:
        in_features = 2 * values.shape[2]
        return KernelWeight(values, scales, INT4_GROUPS.value, in_features // scales.shape[2], in_features)
    raise ValueError(f"expert weights are fp8 or packed int4, not {values.dtype}")
