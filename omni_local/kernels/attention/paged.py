"""Paged attention in Triton: the KV read in place from the pools through the block tables.

One program per (sequence, kv head, tile of new tokens, split of the KV rows) takes the query heads
of its kv head's group together (K and V loaded once per group), and walks its rows BLOCK_N at a
time (several blocks, each row found through the block table) with an online softmax in float32.
Rows past the tile's last allowed row are never loaded (their loads are masked to 0), and scores
past each query's own row are -inf before the exponential: whatever those rows hold, NaN too, never
reaches the output. (In a tail, a query's tile also loads the rows of its later new tokens, masked:
this forward's own rows, numbers unless the forward itself made NaN.)

- A decode step (L = 1), the fast path: the KV walk is split among programs (flash-decoding), so
  B = 1 with a long context still fills the GPU; each program writes its partial (max, sum,
  unnormalised output) to a float32 scratch buffer, and the last of a tile's splits to finish
  (kernels/last_arrival.py) merges each query's splits in split order. A query's splits are
  DECODE_SPLIT_ROWS rows each, or as many more (in whole BLOCK_N) as keep them to MAX_DECODE_SPLITS:
  chosen on the device from the query's own rows, never from the batch or the table's width, so its
  reduction order is the same however the batch looks. (On an H200, 64-row splits took a 256-row
  context's attention from 13.9 to 10.9 µs a layer and a 1,024-row one's from 17.7 to 12.6, but
  fixed 64-row splits (64 of them at 4,096 rows) took 16 chats' from 54.2 to 66.7:
  docs/benchmarks/2026-12-03-attention-split-warm-start.md.)
  The batch-invariant form splits every SPLIT_ROWS rows, as its tails.
- A short tail of 1 < L <= SPLIT_TAIL_TOKENS new tokens on a cached prefix (a new question on a
  cached conversation): a few query tiles, so its rows are split too, into at most MAX_TAIL_SPLITS
  splits of SPLIT_ROWS rows or more, and merged as a decode step's are. (A 27-token question on a
  2,100-token prefix: 16 programs unsplit, 144 with rows to walk split, on an H200's 132 SMs.)
- A longer tail (a prefill chunk) has tiles enough: one program per (sequence, kv head, tile of new
  tokens) walks the whole table, no split, and writes the output itself. Its walk is one running
  softmax in BLOCK_N tiles, not a decode step's splits: the same row's output rounds differently
  from a tail and from a decode step (the deterministic setting's batch-invariant form splits every
  tail as a decode step, in one program).

Capturable in a CUDA graph: the grid and the scratch buffers come from the tensors' shapes only
(the table's width, not the sequences' lengths), each query's last row is read on the device, and
nothing is read back to the host. Programs past a sequence's end return at once.
"""

import torch
import triton
import triton.language as tl

from omni_local.kernels.attention import QueryNormRope
from omni_local.kernels.last_arrival import arrival_counters, last_to_arrive
from omni_local.kernels.triton_support import dot_precision

DECODE_SPLIT_ROWS = 64  # the fewest KV rows a decode step's program walks (a multiple of BLOCK_N)
MAX_DECODE_SPLITS = 16  # the most programs a decode step's query splits its rows among
# KV rows per split of the batch-invariant walk, and the fewest of a short tail's split (SGLang's
# deterministic mode also fixes 256)
SPLIT_ROWS = 256
BLOCK_N = 64  # KV rows per loop iteration: a tile of the scores' columns
TAIL_QUERIES = 64  # query rows (new tokens x the group's heads) per program of an L > 1 tail
SPLIT_TAIL_TOKENS = 64  # the longest tail whose rows are split
MAX_TAIL_SPLITS = 16  # bounds a split tail's float32 scratch: 16 x its output, in float32
MIN_DOT = 16  # tl.dot's smallest tile side
LOG2E = tl.constexpr(1.4426950408889634)  # scores in base 2: exp2 is the GPU's native exponential


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, table_ptr, rows_ptr, out_ptr, acc_ptr,
                      stats_ptr, counters_ptr, norm_ptr, cos_ptr, sin_ptr, scale, eps, length,
                      heads, kv_heads, table_width, split_rows, num_splits, max_splits, q_stride_b, q_stride_h,
                      q_stride_l, pool_stride_block, pool_stride_head, pool_stride_row, table_stride,
                      rows_stride, rotary_stride_b, rotary_stride_l, scale_stride_block, scale_stride_head,
                      scale_stride_row, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_L: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
                      SPLIT_LOOP: tl.constexpr, QUERY_SPLITS: tl.constexpr, NORM_ROPE: tl.constexpr,
                      FP8_KV: tl.constexpr, DOT_PRECISION: tl.constexpr):
    sequence = tl.program_id(0) // kv_heads
    kv_head = tl.program_id(0) % kv_heads
    # Query row m of the tile: new token `token`, query head `head` of this kv head's group.
    m = tl.arange(0, BLOCK_L * BLOCK_G)
    token = tl.program_id(1) * BLOCK_L + m // BLOCK_G
    head = kv_head * GROUP + m % BLOCK_G
    real = (token < length) & (m % BLOCK_G < GROUP)
    d = tl.arange(0, BLOCK_D)
    in_dim = d < HEAD_DIM
    last = tl.load(rows_ptr + sequence * rows_stride + token, mask=real, other=-1)  # [M] each one's last row
    tile_end = tl.minimum(tl.max(last, axis=0) + 1, table_width * BLOCK_SIZE)  # past the tile's last row
    q_at = sequence.to(tl.int64) * q_stride_b + head[:, None] * q_stride_h + token[:, None] * q_stride_l
    q = tl.load(q_ptr + q_at + d[None, :], mask=real[:, None] & in_dim[None, :], other=0.0)
    if NORM_ROPE:
        rotary_at = sequence.to(tl.int64) * rotary_stride_b + token[:, None] * rotary_stride_l
        q = _normed_and_rotated(q, q_ptr + q_at, norm_ptr, cos_ptr + rotary_at, sin_ptr + rotary_at, eps, d,
                                real[:, None] & in_dim[None, :], HEAD_DIM)
    # An fp8 pool's scales: the key and value scales' pointers at this kv head, and their strides.
    scales = (k_scales_ptr + kv_head * scale_stride_head, v_scales_ptr + kv_head * scale_stride_head,
              scale_stride_block, scale_stride_row)
    if SPLIT_LOOP:
        # Every split of the tile's rows in turn, each walked as a decode step's program walks it and
        # merged in split order as a decode step's last split merges them: the same sums, in one program.
        row_max, row_sum, acc = _walk(q, k_ptr, v_ptr, scales, table_ptr, sequence * table_stride,
                                      kv_head * pool_stride_head, pool_stride_block, pool_stride_row, last, 0,
                                      tl.minimum(split_rows, tile_end), scale, d, in_dim, BLOCK_L * BLOCK_G, BLOCK_D,
                                      BLOCK_SIZE, BLOCK_N, FP8_KV, DOT_PRECISION)
        for split_start in range(split_rows, tile_end, split_rows):
            split_max, split_sum, split_acc = _walk(
                q, k_ptr, v_ptr, scales, table_ptr, sequence * table_stride, kv_head * pool_stride_head,
                pool_stride_block, pool_stride_row, last, split_start, tl.minimum(split_start + split_rows, tile_end),
                scale, d, in_dim, BLOCK_L * BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N, FP8_KV, DOT_PRECISION)
            merged_max, merged_sum, merged_acc = _merge(row_max, row_sum, acc, split_max, split_sum, split_acc)
            holds = split_start <= last  # a query merges the splits holding its rows, as _merged_splits does
            row_max = tl.where(holds, merged_max, row_max)
            row_sum = tl.where(holds, merged_sum, row_sum)
            acc = tl.where(holds[:, None], merged_acc, acc)
    else:
        if QUERY_SPLITS:  # a decode step: one token, its splits from its own rows (split_rows the fewest)
            split_rows = _rows_per_split(tl.max(last, axis=0) + 1, split_rows, max_splits, BLOCK_N)
        first_row = tl.program_id(2) * split_rows
        end = tl.minimum(first_row + split_rows, tile_end)
        if first_row >= end:
            return  # a split past every query's rows: the merge never reads it
        row_max, row_sum, acc = _walk(q, k_ptr, v_ptr, scales, table_ptr, sequence * table_stride,
                                      kv_head * pool_stride_head, pool_stride_block, pool_stride_row, last, first_row,
                                      end, scale, d, in_dim, BLOCK_L * BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N, FP8_KV,
                                      DOT_PRECISION)
    out_row = (sequence.to(tl.int64) * length + token) * heads + head  # (b, l, head) of [B, L, heads]
    keep = real[:, None] & in_dim[None, :]
    if PARTIAL:  # scratch [B * L * heads, num_splits, HEAD_DIM] and its stats [.., num_splits, 2], float32
        at = out_row * num_splits + tl.program_id(2)
        tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=keep)
        tl.store(stats_ptr + at * 2, row_max, mask=real)
        tl.store(stats_ptr + at * 2 + 1, row_sum, mask=real)
        # The tile's splits that walk rows (first_row < tile_end) count in; the last merges them all.
        arrivals = tl.minimum(tl.cdiv(tile_end, split_rows), num_splits)
        counter = counters_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if not last_to_arrive(counter, arrivals):
            return
        row_max, row_sum, acc = _merged_splits(acc_ptr, stats_ptr, out_row * num_splits, arrivals, split_rows,
                                               last, real, d, in_dim, HEAD_DIM)
    # Every real query has row 0 allowed: its sum is > 0.
    out = acc / tl.where(real, row_sum, 1.0)[:, None]
    tl.store(out_ptr + out_row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _normed_and_rotated(q, q_rows, norm_ptr, cos_rows, sin_rows, eps, d, keep, HEAD_DIM: tl.constexpr):
    """The query rows `q` [M, BLOCK_D] (at `q_rows` [M, 1]) through the layer's q_norm, an RMSNorm
    over head_dim with weight `norm_ptr` [HEAD_DIM] and `eps`, then the rotary embedding (each row's
    cos and sin [HEAD_DIM] at `cos_rows`, `sin_rows` [M, 1]): what transformers' layer does to its
    queries, rounded to their dtype where its modules return. rotate_half's half of a row is the
    other half of the same row, loaded again where it pairs."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    in_dim = d < HEAD_DIM
    dtype = q.dtype
    value = q.to(tl.float32)
    partner_value = tl.load(q_rows + partner[None, :], mask=keep, other=0.0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(value * value, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(norm_ptr + d, mask=in_dim, other=0.0)[None, :]
    partner_weight = tl.load(norm_ptr + partner, mask=in_dim, other=0.0)[None, :]
    normed = (weight * (value * inverse_rms).to(dtype)).to(dtype)
    partner_normed = (partner_weight * (partner_value * inverse_rms).to(dtype)).to(dtype)
    rotated = tl.where(d[None, :] < half, -partner_normed, partner_normed)  # rotate_half's row
    cos = tl.load(cos_rows + d[None, :], mask=keep, other=0.0)
    sin = tl.load(sin_rows + d[None, :], mask=keep, other=0.0)
    return ((normed * cos).to(dtype) + (rotated * sin).to(dtype)).to(dtype)


@triton.jit
def _walk(q, k_ptr, v_ptr, scales, table_ptr, table_row, head_at, block_stride, row_stride, last, first_row, end,
          scale, d, in_dim, M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
          FP8_KV: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax of the query rows `q` [M, BLOCK_D] over the sequence's rows [first_row, end)
    (its table row at `table_ptr + table_row`; the kv head's rows at `head_at` in each block), BLOCK_N
    at a time, each query row over its rows up to `last` [M]: (max [M], sum [M], unnormalised output
    [M, BLOCK_D]), float32. FP8_KV: the pools are fp8, each row read as its values times its scale
    (`scales`: the kv head's key and value scales, and their block and row strides), in float32
    rounded once to the query's dtype, as kv_fp8.read_rows reads them."""
    row_max = tl.full([M], -float("inf"), dtype=tl.float32)
    row_sum = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BLOCK_D], dtype=tl.float32)
    for start in range(first_row, end, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        inside = rows < end
        block = tl.load(table_ptr + table_row + rows // BLOCK_SIZE, mask=inside, other=0)
        row_at = block.to(tl.int64) * block_stride + head_at + (rows % BLOCK_SIZE) * row_stride
        k = tl.load(k_ptr + row_at[None, :] + d[:, None], mask=in_dim[:, None] & inside[None, :], other=0.0)
        if FP8_KV:
            k_scales = _row_scales(scales[0], block, rows, inside, scales[2], scales[3], BLOCK_SIZE)
            k = (k.to(tl.float32) * k_scales[None, :]).to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * (scale * LOG2E)  # [M, BLOCK_N]
        allowed = (rows[None, :] <= last[:, None]) & inside[None, :]
        scores = tl.where(allowed, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row with nothing allowed yet (padding lanes) keeps -inf: subtract 0 there, not -inf.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        weights = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(weights, axis=1)
        v = tl.load(v_ptr + row_at[:, None] + d[None, :], mask=inside[:, None] & in_dim[None, :], other=0.0)
        if FP8_KV:
            v_scales = _row_scales(scales[1], block, rows, inside, scales[2], scales[3], BLOCK_SIZE)
            v = (v.to(tl.float32) * v_scales[:, None]).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def _row_scales(scales_ptr, block, rows, inside, block_stride, row_stride, BLOCK_SIZE: tl.constexpr):
    """The scales [BLOCK_N] of an fp8 pool's `rows` (each in its `block`), at `scales_ptr`, float32."""
    return tl.load(scales_ptr + block.to(tl.int64) * block_stride + (rows % BLOCK_SIZE) * row_stride,
                   mask=inside, other=0.0)


@triton.jit
def _rows_per_split(rows, fewest, max_splits, BLOCK_N: tl.constexpr):
    """The rows each split of a query's `rows` rows walks: `fewest`, or as many more, in whole
    BLOCK_N, as make at most `max_splits` splits."""
    return tl.maximum(fewest, tl.cdiv(tl.cdiv(rows.to(tl.int32), max_splits), BLOCK_N) * BLOCK_N)


@triton.jit
def _merge(row_max, row_sum, acc, split_max, split_sum, split_acc):
    """Running (max [M], sum [M], output [M, BLOCK_D]) with one more split's (flash-decoding's merge)."""
    new_max = tl.maximum(row_max, split_max)
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a padding lane's: -inf stays, no NaN
    old_scale, split_scale = tl.exp2(row_max - shift), tl.exp2(split_max - shift)
    return (new_max, row_sum * old_scale + split_sum * split_scale,
            acc * old_scale[:, None] + split_acc * split_scale[:, None])


@triton.jit
def _merged_splits(acc_ptr, stats_ptr, first, splits, split_rows, last, real, d, in_dim, HEAD_DIM: tl.constexpr):
    """Each query row's (max, sum, unnormalised output) over the first `splits` splits' partials in
    the scratch (its splits at `first` [M] on), merged in split order; a query merges only the
    splits holding its rows (0..last), so its sums are the same whatever its tile's other rows."""
    keep = real[:, None] & in_dim[None, :]
    # Split 0 always holds row 0: start from it, so a real query's max is never -inf.
    row_max = tl.load(stats_ptr + first * 2, mask=real, other=0.0, cache_modifier=".cg")
    row_sum = tl.load(stats_ptr + first * 2 + 1, mask=real, other=0.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + first[:, None] * HEAD_DIM + d[None, :], mask=keep, other=0.0, cache_modifier=".cg")
    for split in range(1, splits):  # in split order: the same sums however the batch looks
        at = first + split
        merged_max, merged_sum, merged_acc = _merge(
            row_max, row_sum, acc, tl.load(stats_ptr + at * 2, mask=real, other=0.0, cache_modifier=".cg"),
            tl.load(stats_ptr + at * 2 + 1, mask=real, other=0.0, cache_modifier=".cg"),
            tl.load(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=keep, other=0.0, cache_modifier=".cg"))
        holds = split * split_rows <= last
        row_max = tl.where(holds, merged_max, row_max)
        row_sum = tl.where(holds, merged_sum, row_sum)
        acc = tl.where(holds[:, None], merged_acc, acc)
    return row_max, row_sum, acc


def paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    block_tables: torch.Tensor, query_rows: torch.Tensor, scaling: float,
                    decode_split_rows: int = DECODE_SPLIT_ROWS, batch_invariant: bool = False,
                    norm_rope: QueryNormRope | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention [B, L, heads, head_dim] of `query` [B, heads, L, head_dim] over the pools
    [num_blocks, kv_heads, block_size, head_dim] through `block_tables` [B, max_blocks] (int32 or
    int64); new token (b, l) attends to rows 0..query_rows[b, l] of sequence b. Softmax and sums in
    float32; the output in the query's dtype. `decode_split_rows`, the fewest rows of a decode step's
    split (a multiple of BLOCK_N), is for bench.paged_attention to time others: the engine keeps
    DECODE_SPLIT_ROWS.

    `batch_invariant`: a token's output is the same bits whatever L, the batch and the prefix are (the
    deterministic setting): one query tile for every L, a tail's rows split as a decode step's and
    merged in the same order (in its program), and no multiply-add fused where the other would not.

    `norm_rope`: `query` is the layer's projection alone; each program norms and rotates its query
    rows as it loads them (a split's programs each for themselves: a few hundred multiply-adds).

    `scales`: the pools are fp8 (kv_fp8.py), these their rows' (key, value) scales [num_blocks,
    kv_heads, block_size], float32; each row is read as its values times its scale."""
    batch, heads, length, head_dim = query.shape
    _, kv_heads, block_size, _ = key_pool.shape
    check_layout(query, key_pool, value_pool, block_tables, query_rows)
    assert decode_split_rows % BLOCK_N == 0, decode_split_rows
    group = heads // kv_heads
    rows = block_tables.shape[1] * block_size
    split_loop = batch_invariant and length > 1
    query_splits = length == 1 and not batch_invariant
    if query_splits:  # the fewest rows a split walks; the most splits any query of these tables makes
        split_rows, num_splits = decode_split_rows, min(triton.cdiv(rows, decode_split_rows), MAX_DECODE_SPLITS)
    else:
        split_rows = _split_rows(length, rows, split_loop)
        num_splits = 1 if split_loop else triton.cdiv(rows, split_rows)
    block_l, block_g = query_tile(group, length, batch_invariant)
    out = query.new_empty((batch, length, heads, head_dim))
    grid = (batch * kv_heads, triton.cdiv(length, block_l), num_splits)
    if num_splits > 1:
        partial_out = torch.empty((batch * length * heads, num_splits, head_dim), dtype=torch.float32,
                                  device=query.device)
        stats = torch.empty((batch * length * heads, num_splits, 2), dtype=torch.float32, device=query.device)
        counters = arrival_counters(query.device, grid[0] * grid[1])
    else:
        partial_out = stats = counters = out  # one split writes the output itself; none is read
    fusion = {"enable_fp_fusion": False} if batch_invariant else {}
    norm, cos, sin, eps, rotary_strides = _norm_rope_arguments(norm_rope, query)
    key_scales, value_scales, scale_strides = _scale_arguments(scales, key_pool, query)
    _attention_kernel[grid](query, key_pool, value_pool, key_scales, value_scales, block_tables, query_rows, out, partial_out, stats, counters,
                            norm, cos, sin, scaling, eps, length, heads, kv_heads, block_tables.shape[1], split_rows,
                            num_splits, MAX_DECODE_SPLITS, query.stride(0),
                            query.stride(1), query.stride(2), key_pool.stride(0), key_pool.stride(1),
                            key_pool.stride(2), block_tables.stride(0), query_rows.stride(0), *rotary_strides,
                            *scale_strides,
                            GROUP=group, BLOCK_G=block_g, BLOCK_L=block_l, HEAD_DIM=head_dim,
                            BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
                            PARTIAL=num_splits > 1, SPLIT_LOOP=split_loop, QUERY_SPLITS=query_splits,
                            NORM_ROPE=norm_rope is not None, FP8_KV=scales is not None, DOT_PRECISION=dot_precision(query.dtype),
                            num_warps=4, num_stages=2, **fusion)
    return out


def _norm_rope_arguments(norm_rope: QueryNormRope | None, query: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, tuple[int, int]]:
    """The kernel's (norm weight, cos, sin, eps, (cos's and sin's batch and token strides)); with
    no `norm_rope`, the query in their place, never read."""
    if norm_rope is None:
        return query, query, query, 0.0, (0, 0)
    batch, _, length, head_dim = query.shape
    cos, sin = norm_rope.cos, norm_rope.sin
    assert norm_rope.weight.shape == (head_dim,) and norm_rope.weight.is_contiguous(), norm_rope.weight.shape
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1, (cos.shape, sin.shape)
    assert cos.shape[0] in (1, batch) and cos.shape[1:] == (length, head_dim), (cos.shape, query.shape)
    assert head_dim % 2 == 0, head_dim
    batch_stride = cos.stride(0) if cos.shape[0] == batch else 0  # one sequence's rotary for all: broadcast
    return norm_rope.weight, cos, sin, norm_rope.eps, (batch_stride, cos.stride(1))


def _scale_arguments(scales: tuple[torch.Tensor, torch.Tensor] | None, key_pool: torch.Tensor, query: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """The kernel's (key scales, value scales, (their block, head and row strides)); with no `scales`,
    the query in their place, never read."""
    if scales is None:
        return query, query, (0, 0, 0)
    key_scales, value_scales = scales
    if key_scales.shape != key_pool.shape[:3] or value_scales.shape != key_scales.shape:
        raise ValueError(f"the scales {tuple(key_scales.shape)}, {tuple(value_scales.shape)} are not one per row "
                         f"of the pools {tuple(key_pool.shape)}")
    if value_scales.stride() != key_scales.stride() or key_scales.dtype != torch.float32:
        raise ValueError("the key and value scales must be float32 of one layout")
    return key_scales, value_scales, key_scales.stride()


def _split_rows(length: int, rows: int, split_loop: bool) -> int:
    """KV rows per split for `length` new tokens over tables of `rows` rows, but for a decode step's
    own splits: the batch-invariant form's (a decode step's, and a tail's, looped in its program), a
    short tail's (as many, or more where the table would make more than MAX_TAIL_SPLITS), or a long
    tail's whole table."""
    if length == 1 or split_loop:
        return SPLIT_ROWS
    if length <= SPLIT_TAIL_TOKENS:
        return max(SPLIT_ROWS, triton.cdiv(rows, MAX_TAIL_SPLITS * BLOCK_N) * BLOCK_N)
    return rows


def grid_follows_rows(length: int) -> bool:
    """Whether a forward of `length` new tokens launches programs by its block tables' width (a
    decode step's and a short tail's splits of the rows, a program each, those past a sequence's end
    returning at once), so that a CUDA graph over fewer rows launches fewer. A longer tail's programs
    each walk their own tokens' rows, however wide the tables."""
    return length <= SPLIT_TAIL_TOKENS


def query_tile(group: int, length: int, batch_invariant: bool = False) -> tuple[int, int]:
    """(new tokens, heads of the group) per program: a decode step's one token with its group's
    heads; a tail's tokens by TAIL_QUERIES query rows (`batch_invariant`: every L's, a decode step's
    too, so each token's products are one tl.dot shape's). At least MIN_DOT rows, as tl.dot needs."""
    block_g = triton.next_power_of_2(group)
    tail_tokens = max(1, TAIL_QUERIES // block_g)
    if batch_invariant:
        block_l = tail_tokens
    else:
        block_l = 1 if length == 1 else min(tail_tokens, triton.next_power_of_2(length))
    return block_l, max(block_g, MIN_DOT // block_l)


def check_layout(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                 block_tables: torch.Tensor, query_rows: torch.Tensor) -> None:
    """The kernel indexes the value pool with the key pool's strides, and steps through head_dim,
    a table row and a row of query rows one element at a time."""
    if value_pool.shape != key_pool.shape or value_pool.stride() != key_pool.stride():
        raise ValueError("the key and value pools must have one shape and one layout")
    if query.stride(-1) != 1 or key_pool.stride(-1) != 1:
        raise ValueError("the query's and the pools' head_dim must be contiguous")
    if block_tables.stride(1) != 1 or query_rows.stride(1) != 1:
        raise ValueError("the block tables' and the query rows' rows must be contiguous")
    if query.shape[1] % key_pool.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key_pool.shape[1]} kv heads")
