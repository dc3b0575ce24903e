"""A decoder layer's query, key and value projections as one weight: one matmul where there were three.

At decode the three are GEMVs bound by reading their weights (q 2048->4096, k and v 2048->512 in the
Thinker): one launch over the concatenated rows reads the same bytes at a better rate and saves two
launches a layer. Each output element is the same dot product as before, so on the CPU the fused
product equals the three bit for bit; on a GPU the library may pick another kernel for the wider
weight, which can round differently.

`fuse_qkv(stack)` registers `self_attn.qkv_proj` (a Linear, or a QuantizedLinear of the same format)
in each layer, and leaves transformers' q_proj, k_proj and v_proj in place as views of its rows,
outside the module tree: transformers' own forward (the tests' reference, the bench's baseline)
still runs, on the same memory, and the weights are counted once. The views are made once, on the
device: move the model before fusing, not after.
"""

import torch

from omni_local.model.quantized import QuantizedLinear

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(stack: torch.nn.Module) -> None:
    """Fuse every layer's projections of `stack` (a decoder stack: `.layers`); a fused layer is left as it is."""
    for layer in stack.layers:
        attention = layer.self_attn
        if "qkv_proj" not in attention._modules:
            _fuse(attention)


def split_qkv(attention: torch.nn.Module, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values [..., features] of `normed` through the fused projection."""
    return attention.qkv_proj(normed).split(attention.qkv_sizes, dim=-1)


def _fuse(attention: torch.nn.Module) -> None:
    parts = [getattr(attention, name) for name in PROJECTIONS]
    sizes = [part.out_features for part in parts]
    if isinstance(parts[0], QuantizedLinear):
        fused = QuantizedLinear.concatenated(parts)
    else:
        assert all(type(p) is torch.nn.Linear for p in parts), parts
        fused = _fused_linear(parts)
    attention.qkv_proj = fused
    attention.qkv_sizes = sizes
    for name, part, rows in zip(PROJECTIONS, parts, _row_ranges(sizes)):
        _view_rows(part, fused, rows)
        del attention._modules[name]
        attention.__dict__[name] = part  # still `attention.q_proj` for transformers' forward, not a submodule


def _fused_linear(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    weight = torch.cat([p.weight for p in parts])
    fused = torch.nn.Linear(parts[0].in_features, weight.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = torch.nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def _row_ranges(sizes: list[int]) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(start, start + size) for start, size in zip(starts, sizes)]


def _view_rows(part: torch.nn.Module, fused: torch.nn.Module, rows: slice) -> None:
    """Point `part`'s tensors at its rows of `fused`'s, so its own copy is freed."""
    if isinstance(part, QuantizedLinear):
        part.values, part.scales = fused.values[rows], fused.scales[rows]
    else:
        part.weight = torch.nn.Parameter(fused.weight[rows], requires_grad=False)
    if part.bias is not None:
        part.bias = torch.nn.Parameter(fused.bias[rows], requires_grad=False)
