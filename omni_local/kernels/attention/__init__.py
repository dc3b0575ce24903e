"""Our attention over a paged KV (paged.py: the kernel, which imports Triton) and what a layer does
to its queries first (`QueryNormRope`), which the kernel applies as it loads them: in a decode step
that is one launch a layer fewer than a kernel of their own (the compiled layers' way:
engine/forward/decoder_stack.py). The engine chooses when it runs (engine/memory/attention/)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QueryNormRope:
    """What a Qwen3-style layer does to its queries before attention: its q_norm, an RMSNorm over
    head_dim (`weight` [head_dim], `eps`), then the rotary embedding (`cos`, `sin` [B or 1, L,
    head_dim], as transformers' apply_rotary_pos_emb takes them)."""

    weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
