"""Attention over a paged KV: per decoder layer a key pool and a value pool, each
[num_blocks, kv_heads, block_size, head_dim], and per sequence a row of `block_tables` listing its
blocks in order (token t of sequence b at pool[block_tables[b, t // block_size], :, t % block_size]).

- `paged_attention` (kernels/attention/paged.py): our Triton kernels, reading the blocks in place;
  CUDA-graph capturable. It imports Triton, so it is imported only when asked for.
- `gathered_attention` (reference.py): the blocks gathered into contiguous KV, then PyTorch's
  SDPA; the reference the kernel is tested and benchmarked against.

`attention_kernels` makes the `attention_backend` and `deterministic` settings the kernels the
Thinker's and the Talker's forwards attend with (`AttentionKernels`): decode steps' and graphed
prefills' on a cached prefix (the backend's), and every other prefill's (the deterministic
setting's only). None is transformers' attention over the rows gathered from the blocks
(kv_store.py): the engine's path off CUDA, with 'torch', for eager prefills on a prefix (their own
rows, no bucket), and for first prefills, whose tokens attend among themselves (flash attention's
kernel: no mask, nothing gathered).

Both take (query [B, heads, L, head_dim], key_pool, value_pool, block_tables [B, max_blocks],
query_rows [B, L], scaling) and return [B, L, heads, head_dim] in the query's dtype: new token
(b, l) attends to rows 0..query_rows[b, l] of its own sequence. `paged_attention` also takes the
query as the layer's projection made it, with the layer's `QueryNormRope` to apply as it loads it:
in a decode step that is one launch a layer fewer than a kernel of their own (the compiled layers'
way: decoder_stack.py).
"""

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from omni_local.engine.memory.attention.reference import gathered_attention
from omni_local.kernels.attention import QueryNormRope
from omni_local.kernels.triton_support import triton_refusal, uses_triton
from omni_local.errors import SettingsError

__all__ = ["AttentionKernels", "PagedAttention", "attention_kernels", "backend_kernel", "gathered_attention",
           "without_cudnn_attention"]


class PagedAttention(Protocol):
    """(query, key_pool, value_pool, block_tables, query_rows, scaling, norm_rope=None, scales=None)
    -> [B, L, heads, head_dim]; `scales`: fp8 pools' (key, value) scales (kv_fp8.py)"""

    def __call__(self, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                 block_tables: torch.Tensor, query_rows: torch.Tensor, scaling: float, *,
                 norm_rope: QueryNormRope | None = None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels a stack's forwards attend with over the blocks: decode steps'; graphed prefills'
    on a cached prefix (a prompt's tail, a later chunk: the prefix read in place, where the graph
    would gather its whole bucket of rows); and with `everywhere` (the deterministic setting, whose
    rows must not depend on how they were computed) every prefill's, eager and from a sequence's
    first token too. None: transformers' attention over the rows gathered from the blocks.

    Eager prefills keep transformers' attention otherwise: they come at any length, and Triton
    compiles a kernel anew for integer arguments it has not met (whether each is 1 or a multiple of
    16 is part of a compiled kernel's key), a second or more in someone's turn; every graph's
    shapes are met at start-up."""

    decode: PagedAttention | None = None
    prefill: PagedAttention | None = None
    everywhere: bool = False

    @property
    def eager_prefill(self) -> PagedAttention | None:
        """The kernel an eager prefill attends with."""
        return self.prefill if self.everywhere else None


def attention_kernels(setting: str, device: torch.device, deterministic: bool = False) -> AttentionKernels:
    """The `attention_backend` setting's kernel for decode steps and graphed prefills on a prefix;
    with `deterministic`, our kernel in its batch-invariant form for every forward (a SettingsError
    where Triton cannot run)."""
    if not deterministic:
        kernel = backend_kernel(setting, device)
        return AttentionKernels(kernel, kernel)
    refusal = triton_refusal(device)
    if refusal:
        raise SettingsError(f"setting 'deterministic' runs our Triton kernels, but {refusal}: set it to false")
    from omni_local.kernels.attention.paged import paged_attention  # imports triton

    kernel = partial(paged_attention, batch_invariant=True)
    return AttentionKernels(kernel, kernel, everywhere=True)


def backend_kernel(setting: str, device: torch.device) -> PagedAttention | None:
    """The kernel for `attention_backend`: 'triton', our kernel; 'torch', None; 'auto', triton on a
    CUDA GPU that runs it. 'triton' where Triton cannot run is a SettingsError saying why."""
    if not uses_triton("attention_backend", setting, device):
        return None
    from omni_local.kernels.attention.paged import paged_attention  # imports triton

    return paged_attention


def without_cudnn_attention() -> None:
    """Keep PyTorch's SDPA, in this process, off cuDNN's attention, which it chose on an H200 (torch
    2.11): cuDNN builds an execution plan for an attention it has not met, and the shapes of eager
    prefills, the encoders' media and a prompt's chunks are the user's. There the first Talker
    prompt on a cached prefix spent 1.1 s in it, between a voice chat's first token and its first
    audio (later calls 0.1 ms). Flash and memory-efficient attention run precompiled kernels; SDPA
    takes them instead."""
    torch.backends.cuda.enable_cudnn_sdp(False)

