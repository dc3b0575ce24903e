"""How a weight matrix is stored when it is quantized, and the arithmetic to get there and back.

Three formats, each on a weight's last dimension being the reduction (K, a matmul's `in_features`):
- `fp8`: float8 e4m3 values with one float32 scale per output row (per channel), w ≈ q * scale.
- `int8`: int8 values in [-127, 127] with one scale per output row (made in float32).
- `int4`: signed 4-bit values in [-8, 7] with one scale per group of `group` consecutive inputs of a
  row, in the model's dtype. Two values a byte along K, the even one in the low nibble, each stored
  plus 8: the bytes of compressed-tensors' int32 packing read as uint8 on a little-endian machine.

Scales are symmetric (no zero point): a row's or group's largest magnitude maps to the format's
largest value. Leading dimensions (the experts of a 3-D weight) are carried through untouched.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

QuantFormat = Literal["fp8", "int8", "int4"]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT4_GROUP = 128


@dataclass(frozen=True)
class Quantized:
    """A quantized weight: `values` (fp8 [..., N, K], int8 [..., N, K] or packed int4 uint8
    [..., N, K/2]) and `scales` ([..., N], or int4's [..., N, K/group])."""

    format: QuantFormat
    values: torch.Tensor
    scales: torch.Tensor
    group: int = 0  # inputs per int4 scale

    @property
    def in_features(self) -> int:
        return self.values.shape[-1] * (2 if self.format == "int4" else 1)


def int4_group(in_features: int) -> int:
    """The int4 group size for rows of `in_features`: 128, or the largest power of two dividing
    the row below that (small test models), at least 16 (the kernels' smallest reduction tile)."""
    group = INT4_GROUP
    while in_features % group:
        group //= 2
    if group < 16:
        raise ValueError(f"int4 needs rows of a multiple of 16 inputs, got {in_features}")
    return group


def quantized_bytes(shape: tuple[int, ...], format: QuantFormat, dtype: torch.dtype, group: int | None = None) -> int:
    """The bytes a weight of `shape` [..., N, K] of a model in `dtype` takes in `format` (int4 in
    groups of `group`, or of `quantize`'s choice)."""
    *rows, in_features = shape
    count = math.prod(rows)
    if format == "int4":
        return count * (in_features // 2 + in_features // (group or int4_group(in_features)) * dtype.itemsize)
    scale_bytes = 4 if format == "fp8" else dtype.itemsize  # int8's scales are kept in the model's dtype
    return count * (in_features + scale_bytes)


def quantize(weight: torch.Tensor, format: QuantFormat) -> Quantized:
    """`weight` [..., N, K] in `format`, computed in float32 on the weight's device."""
    w = weight.float()
    if format == "int4":
        group = int4_group(w.shape[-1])
        grouped = w.unflatten(-1, (-1, group))
        scales = (grouped.abs().amax(-1) / 7.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(grouped / scales[..., None]).clamp_(-8, 7).flatten(-2).to(torch.int16) + 8
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
        return Quantized("int4", packed, scales.to(weight.dtype), group)
    largest = FP8_MAX if format == "fp8" else 127.0
    scales = (w.abs().amax(-1) / largest).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = w / scales[..., None]
    values = scaled.to(FP8) if format == "fp8" else torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    return Quantized(format, values, scales)


def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """The signed values [..., N, K] int8 of packed int4 bytes [..., N, K/2]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(weight: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The weight [..., N, K] in `dtype`: values times scales, in float32, rounded once."""
    if weight.format == "int4":
        values = int4_values(weight.values).float().unflatten(-1, (-1, weight.group))
        return (values * weight.scales.float()[..., None]).flatten(-2).to(dtype)
    return (weight.values.float() * weight.scales[..., None]).to(dtype)
