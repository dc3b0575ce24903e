"""Attention over a paged KV: per decoder layer a key pool and a value pool, each
[num_blocks, kv_heads, block_size, head_dim], and per sequence a row of `block_tables` listing its
blocks in order (token t of sequence b at pool[block_tables[b, t // block_size], :, t % block_size]).

- `paged_attention` (paged.py): our Triton kernels, reading the blocks in place; CUDA-graph
  capturable. It imports Triton, so it is imported only when asked for.
- `gathered_attention` (reference.py): the blocks gathered into contiguous KV, then PyTorch's
  SDPA; the reference the kernel is tested and benchmarked against.

`decode_attention` makes the `attention_backend` setting the kernel decode steps attend with (the
Thinker's and the Talker's), or None: transformers' attention over the rows gathered from the blocks
(kv_store.py), the engine's path off CUDA, for prefills, and with 'torch'.

Both take (query [B, heads, L, head_dim], key_pool, value_pool, block_tables [B, max_blocks],
query_rows [B, L], scaling) and return [B, L, heads, head_dim] in the query's dtype: new token
(b, l) attends to rows 0..query_rows[b, l] of its own sequence.
"""

from collections.abc import Callable
from typing import Any

import torch

from omni_local.engine.attention.reference import gathered_attention
from omni_local.engine.triton_support import uses_triton

__all__ = ["PagedAttention", "decode_attention", "gathered_attention", "paged_attention"]

# (query, key_pool, value_pool, block_tables, query_rows, scaling) -> [B, L, heads, head_dim]
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decode_attention(setting: str, device: torch.device) -> PagedAttention | None:
    """The kernel for `attention_backend`: 'triton', our kernel; 'torch', None; 'auto', triton on a
    CUDA GPU that runs it. 'triton' where Triton cannot run is a SettingsError saying why."""
    if not uses_triton("attention_backend", setting, device):
        return None
    from omni_local.engine.attention.paged import paged_attention  # imports triton

    return paged_attention


def __getattr__(name: str) -> Any:
    if name == "paged_attention":
        from omni_local.engine.attention.paged import paged_attention  # imports triton

        return paged_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
