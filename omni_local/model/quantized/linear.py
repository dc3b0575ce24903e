"""A linear layer whose weight is quantized (formats.py), in place of a `torch.nn.Linear`.

How it multiplies, by format and device:
- a decode batch's few rows (up to GEMV_MAX_ROWS) on a GPU that runs our Triton kernels (and for
  `fp8`, has FP8 units): our GEMV (kernels/gemv.py), which reads the weight once in its stored
  bytes (int4's two values a byte too), converts each tile to the rows' dtype as it loads it, and
  scales the float32 sums; the rows stay as they are (no float8 rounding of the activations);
- `fp8` on a GPU with FP8 matrix units (compute capability 8.9 or newer), more rows: each input row
  is scaled to float8 by its own largest magnitude and `torch._scaled_mm` multiplies float8 by float8
  with both scales in its epilogue (FP8 "dynamic"): the weight is read once, in one byte a value;
- `int8` on the CPU: `torch._weight_int8pack_mm`, the weight read as int8 and scaled per output row
  (its scales kept in the model's dtype, as that op takes them). Not on a GPU, where it is several
  times slower than making the full-precision weight and multiplying by it (below);
- otherwise (int8 and int4 on a GPU past the GEMV's rows, fp8 on the CPU or in a float32 model, and
  int4 on the CPU): the weight dequantized to the input's dtype, then a plain matmul, each call
  making the layer's full-precision weight and freeing it. int4 dense layers come from checkpoints
  quantized before loading (prequantized.py);
- with the deterministic setting (`make_batch_invariant`), one kernel for every row count, so a
  row's sums do not depend on the rows beside it.

A layer made `batched` (the encoders': an image's patches, a clip's frames) never takes the GEMV, so
a compiled encoder's token count, which may be unbacked, meets no guard on its size.
"""

import torch
import torch.nn.functional as F

from omni_local.kernels.triton_support import has_fp8_units, triton_refusal
from omni_local.model.quantized.formats import (FP8, FP8_MAX, QuantFormat, Quantized, dequantize, quantize,
                                                quantized_bytes)

# Rows up to which a GPU multiplies by our GEMV rather than the library's matmuls: a decode batch,
# where cuBLASLt's FP8 kernel (a 128x128 tile) took 9.4 µs a call on an H200 at one row. A guess, to
# be measured (python -m omni_local.bench.dense_projections) where the two meet.
GEMV_MAX_ROWS = 16


class QuantizedLinear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, format: QuantFormat, bias: torch.Tensor | None = None,
                 batched: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, format
        self.batched = batched  # called with many rows only: never by our GEMV
        self.register_buffer("values", None)
        self.register_buffer("scales", None)
        self.fp8_units = False  # whether `forward` multiplies in float8 (`hold` decides)
        self.gemv = False  # whether `forward` multiplies few rows by our GEMV (`hold` decides)
        self.int8_pack = False  # whether `forward` multiplies by `torch._weight_int8pack_mm` (`hold` decides)
        # Whether every row count takes one kernel (`make_batch_invariant` decides), and whether that is
        # the weight dequantized first (int4 in groups the GEMV does not read)
        self.batch_invariant = False
        self.invariant_dequantizes = False
        self.prefilled = False  # filled before loading (read back from disk): the loader hands it nothing
        self.group: int | None = None  # int4's inputs per scale, where known before the weight is (a checkpoint's)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    def replacing(cls, linear: torch.nn.Linear, format: QuantFormat, batched: bool = False) -> "QuantizedLinear":
        """A layer for `linear`'s place: quantized from its weight, unless that is still on the meta
        device (a skeleton being loaded: `take_weight` fills it)."""
        layer = cls(linear.in_features, linear.out_features, format, linear.bias, batched)
        if not linear.weight.is_meta:
            layer.take_weight("weight", linear.weight.detach())
        return layer

    @classmethod
    def concatenated(cls, parts: list["QuantizedLinear"]) -> "QuantizedLinear":
        """One layer whose outputs are `parts`' in order: same inputs, format and way of multiplying."""
        first = parts[0]
        ways = ("format", "in_features", "batched", "fp8_units", "gemv", "int8_pack")
        assert all(isinstance(p, cls) and all(getattr(p, w) == getattr(first, w) for w in ways) for p in parts), parts
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        layer = cls(first.in_features, sum(p.out_features for p in parts), first.format, bias, first.batched)
        layer.values, layer.scales = torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts])
        layer.fp8_units, layer.gemv, layer.int8_pack = first.fp8_units, first.gemv, first.int8_pack
        return layer

    def take_weight(self, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor of the layer it replaces: the weight is quantized on its device."""
        if name == "bias":
            self.bias = torch.nn.Parameter(tensor, requires_grad=False)
            return
        assert name == "weight" and tensor.shape == (self.out_features, self.in_features), (name, tensor.shape)
        weight = quantize(tensor, self.format)
        # int8's scales in the model's dtype, as its matmul takes them (a cast in `forward` would be
        # an input that inductor's lowering of that matmul refuses: torch 2.11).
        self.hold(weight.values, weight.scales.to(tensor.dtype) if self.format == "int8" else weight.scales,
                  tensor.dtype)

    def take_quantized(self, weight: Quantized, dtype: torch.dtype) -> None:
        """The weight as the checkpoint holds it, already quantized in this layer's format."""
        assert weight.format == self.format and weight.in_features == self.in_features, (weight.format, self.format)
        assert weight.values.shape[0] == self.out_features, weight.values.shape
        self.hold(weight.values, weight.scales, dtype)

    def hold(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep a quantized weight (made here, or read back from disk) for a model in `dtype`."""
        self.values, self.scales = values, scales
        # Decided once, here: a capability query in `forward` would be traced into compiled regions.
        # A float32 model keeps float32 products: the scaled matmul gives bfloat16.
        self.fp8_units = self.format == "fp8" and has_fp8_units(values.device) and dtype != torch.float32
        self.gemv = not self.batched and runs_gemv(values.device, self.format, self.weight.group)
        self.int8_pack = self.format == "int8" and values.device.type == "cpu"

    @property
    def empty(self) -> bool:
        """Whether it holds no weight yet (swapped into a model not loaded yet)."""
        return self.values is None

    def planned_bytes(self, dtype: torch.dtype) -> int:
        """The bytes its quantized weight will take once loaded, in a model of `dtype` (its bias is a
        parameter, counted with the others)."""
        return quantized_bytes((self.out_features, self.in_features), self.format, dtype, self.group)

    @property
    def weight(self) -> Quantized:
        group = self.in_features // self.scales.shape[-1] if self.format == "int4" else 0
        return Quantized(self.format, self.values, self.scales, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.batch_invariant and self.invariant_dequantizes:
            out = torch.ops.omni_local.invariant_matmul(rows, dequantize(self.weight, rows.dtype))
        elif self.batch_invariant:
            out = torch.ops.omni_local.quantized_gemv(rows, self.values, self.scales)
        elif self.gemv and rows.shape[0] <= GEMV_MAX_ROWS:  # a shape: compiled code guards on it
            out = torch.ops.omni_local.quantized_gemv(rows, self.values, self.scales)
        elif self.int8_pack:
            out = torch._weight_int8pack_mm(rows, self.values, self.scales)
        elif self.fp8_units:
            out = fp8_matmul(rows, self.values, self.scales)
        else:
            out = F.linear(rows, dequantize(self.weight, rows.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def make_batch_invariant(self) -> None:
        """Multiply every row count by one kernel (the deterministic setting): our GEMV, reading the
        weight in place, or for int4 in groups it does not read, its kernel on the weight dequantized."""
        from omni_local.kernels.gemv import reads_int4_groups  # registers the ops; imports Triton

        self.batch_invariant = True
        self.invariant_dequantizes = self.format == "int4" and not reads_int4_groups(self.weight.group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def runs_gemv(device: torch.device, format: QuantFormat, group: int = 0) -> bool:
    """Whether our GEMV multiplies a weight of `format` (int4: in groups of `group` inputs) on
    `device`: on a CUDA GPU that runs our Triton kernels, for fp8 one with FP8 units (Triton converts
    e4m3 on compute capability 8.9 and newer), for int4 groups it reads. Where it does, its op is
    registered here."""
    if device.type != "cuda" or triton_refusal(device):
        return False
    if format == "fp8" and not has_fp8_units(device):
        return False
    # Imported here: it imports Triton, which torch's CPU wheels lack.
    from omni_local.kernels.gemv import reads_int4_groups  # registers omni_local::quantized_gemv

    return format != "int4" or reads_int4_groups(group)



def fp8_matmul(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows [M, K] times the fp8 weight `values` [N, K] (per-row `scales` [N]) with each input row
    quantized to fp8 by its own scale: [M, N] in the rows' dtype."""
    row_scales = (rows.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = (rows.float() / row_scales).to(FP8)
    # Row-wise scales give bfloat16 out (cuBLASLt's FP8 epilogue), whatever the activations' dtype.
    out = torch._scaled_mm(quantized, values.t(), scale_a=row_scales, scale_b=scales.view(1, -1),
                           out_dtype=torch.bfloat16)
    return out.to(rows.dtype)
