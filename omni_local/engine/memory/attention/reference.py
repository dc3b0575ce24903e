"""Paged attention in plain PyTorch: each sequence's blocks gathered into contiguous KV, then SDPA
with a boolean mask, dispatched over the kv heads as transformers' SDPA attention does it (the
engine's attention today), so over contiguous KV it is the same computation, bit for bit.

It reads a fixed number of blocks per sequence (`blocks`, default the table's width) whatever the
sequences' lengths: a CUDA graph captured for a bucket of rows replays it unchanged.
"""

import torch
import torch.nn.functional as F

from omni_local.engine.memory.kv_fp8 import read_rows
from omni_local.kernels.attention import QueryNormRope


def gathered_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                       block_tables: torch.Tensor, query_rows: torch.Tensor, scaling: float,
                       blocks: int | None = None, norm_rope: QueryNormRope | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention [B, L, heads, head_dim] of `query` [B, heads, L, head_dim] (first through
    `norm_rope`, where given) over the first `blocks` blocks of each sequence's `block_tables` row
    [B, max_blocks] in the pools [num_blocks, kv_heads, block_size, head_dim] (fp8 pools read with
    their rows' (key, value) `scales`, kv_fp8.py); new token (b, l) attends to rows 0..query_rows[b, l]
    of sequence b."""
    if norm_rope is not None:
        query = normed_and_rotated(query, norm_rope)
    table = block_tables[:, : blocks or block_tables.shape[1]]
    key_scales, value_scales = scales or (None, None)
    keys = gathered_rows(key_pool, key_scales, table, query.dtype)
    values = gathered_rows(value_pool, value_scales, table, query.dtype)
    rows = torch.arange(keys.shape[2], device=query.device)
    # Rows past a sequence's last new token may hold anything, NaN too, and a masked score does not
    # cancel a NaN (SDPA adds -inf to it; a zero weight times NaN is NaN): they are zeroed first.
    own = (rows[None, :] <= query_rows.amax(dim=1, keepdim=True))[:, None, :, None]  # [B, 1, rows, 1]
    keys, values = keys.masked_fill(~own, 0), values.masked_fill(~own, 0)
    allowed = rows[None, None, None, :] <= query_rows[:, None, :, None]  # [B, 1, L, rows]
    return grouped_sdpa(query, keys, values, allowed, scaling)


def normed_and_rotated(query: torch.Tensor, norm_rope: QueryNormRope) -> torch.Tensor:
    """`query` [B, heads, L, head_dim] through a layer's q_norm and rotary embedding, as transformers'
    RMSNorm and apply_rotary_pos_emb compute them."""
    dtype = query.dtype
    value = query.float()
    inverse_rms = torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + norm_rope.eps)
    normed = norm_rope.weight * (value * inverse_rms).to(dtype)
    half = query.shape[-1] // 2
    rotated = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1)
    return normed * norm_rope.cos[:, None] + rotated * norm_rope.sin[:, None]


def gathered_rows(pool: torch.Tensor, scales: torch.Tensor | None, table: torch.Tensor, dtype: torch.dtype
                  ) -> torch.Tensor:
    """`gathered(pool, table)` in `dtype`: an fp8 pool's rows read with their `scales` [num_blocks,
    kv_heads, block_size] (kv_fp8.py); another pool's as they are."""
    rows = gathered(pool, table)
    return read_rows(rows, gathered(scales[..., None], table)[..., 0] if scales is not None else None, dtype)


def gathered(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, n * block_size, head_dim]: the n blocks of each `table` row [B, n], in order (also
    how the engine's writers hand transformers' attention a sequence's rows, kv_store.py)."""
    batch, n = table.shape
    _, kv_heads, block_size, head_dim = pool.shape
    picked = pool.index_select(0, table.flatten()).view(batch, n, kv_heads, block_size, head_dim)
    return picked.transpose(1, 2).reshape(batch, kv_heads, n * block_size, head_dim)


def grouped_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """SDPA [B, L, heads, head_dim] of `query` [B, heads, L, head_dim] over `keys` and `values`
    [B, kv_heads, rows, head_dim] under the boolean mask `allowed` [B, 1, L, rows], as transformers'
    sdpa_attention_forward runs it with a mask: a decode step's query heads packed per kv head (CUDA's
    SDPA takes no GQA with a mask but falls back to its slow math kernel), else the kv heads
    repeated."""
    batch, heads, length, head_dim = query.shape
    group = heads // keys.shape[1]
    if group > 1 and length == 1:
        query = query.reshape(batch, heads // group, group, head_dim)  # the mask broadcasts over the group
    elif group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scaling)
    return out.reshape(batch, heads, length, head_dim).transpose(1, 2).contiguous()
