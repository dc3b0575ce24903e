"""An RMSNorm whose every row is normed alone (the deterministic setting's).

transformers' RMSNorm (`weight * (x * rsqrt(mean(x²) + eps)).to(dtype)`, in float32) sums each row
in an order its reduction kernel picks by the number of rows: on a GPU torch splits a row across
warps when there are few rows, inductor picks its tile by the rows' count too. So the same token's
row can round differently in a prefill and in a decode step. Here one program norms one row, its
sum one tl.sum over a tile of the row's width, whatever the other rows: the same operations as
transformers' otherwise, in the same dtypes.

Registered as the torch op `omni_local::rms_norm`: torch.compile leaves it whole inside the
compiled layers, and a CUDA graph captures it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, width, eps, x_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=inside, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / width
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0)
    tl.store(out_ptr + row * width + columns, weight * normed, mask=inside)


@torch.library.custom_op("omni_local::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` [..., width] normed row by row and scaled by `weight` [width] (x's dtype)."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, width, eps, rows.stride(0),
                                           BLOCK=triton.next_power_of_2(width), num_warps=4, enable_fp_fusion=False)
    return out


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)
