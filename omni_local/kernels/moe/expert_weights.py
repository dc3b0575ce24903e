"""An expert weight [E, N, K] as the GEMM kernels take it (its tiles read by kernels/weight_tiles.py)."""

from dataclasses import dataclass

import torch

from omni_local.kernels.weight_tiles import INT4_GROUPS, PLAIN, ROW_SCALED


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

    @property
    def quantized(self) -> str | None:
        """The format's name where the values are quantized ('fp8', 'int4'), as tile configs name it."""
        return {ROW_SCALED.value: "fp8", INT4_GROUPS.value: "int4"}.get(self.format)

    def block_k(self, tile_block_k: int) -> int:
        """The tile's BLOCK_K, at most an int4 group (so one scale covers a tile's k); int4's at least
        32, as its two dots take half of it each and tl.dot takes 16 at least. int4's steps never pass
        K (its kernels load them unmasked along K)."""
        if self.format != INT4_GROUPS.value:
            return tile_block_k
        block_k = min(tile_block_k, self.group)
        assert block_k >= 32 and self.in_features % block_k == 0, (tile_block_k, self.group, self.in_features)
        return block_k


def kernel_weight(values: torch.Tensor, scales: torch.Tensor | None = None) -> KernelWeight:
    """An expert weight for the GEMM kernels: `values` [E, N, K] in the activations' dtype with no
    `scales`, or quantized (model/quantized/formats.py), its format told by the values' dtype."""
    if scales is None:
        return KernelWeight(values, values, PLAIN.value, 0, values.shape[2])
    if values.dtype == torch.float8_e4m3fn:
        return KernelWeight(values, scales, ROW_SCALED.value, 0, values.shape[2])
    if values.dtype == torch.uint8:
        in_features = 2 * values.shape[2]
        return KernelWeight(values, scales, INT4_GROUPS.value, in_features // scales.shape[2], in_features)
    raise ValueError(f"expert weights are fp8 or packed int4, not {values.dtype}")
