"""The (token, k) pairs sorted by expert into blocks of BLOCK_M rows.

Pair p = token * top_k + k is routed to expert `experts[p]`. Each expert's pairs take consecutive
rows, in pair order (a stable sort, so the layout depends only on the routing), and its run is
padded to a whole number of blocks, so every block belongs to one expert and its first row is a
real pair. Padding rows, and the blocks past the last expert's, hold `pairs` (out of range). The
output's size depends only on the pair count (`sorted_rows`), so a CUDA graph captures it, and
nothing is read back to the host.

Two ways to the same rows, bit for bit:
- one program (`_sort_kernel`) walks all pairs three times (fill, count, scatter): one launch, the
  cheapest for a decode batch's few pairs, but serial, so a prefill's thousands of pairs wait on it
  (930 µs a layer for 16,952 pairs on an H200);
- in chunks of CHUNK_PAIRS pairs, three launches: each chunk counts its pairs per expert (and fills
  its share of the rows with padding); one program turns the counts into each expert's run start
  and each chunk's first row in it (earlier chunks' pairs of that expert come first); each chunk
  scatters its pairs from there. Launch order puts the padding before the pairs; no atomics, so
  the rows are the one-program sort's.
"""

import torch
import triton
import triton.language as tl

CHUNK = 64  # pairs (or rows) one loop iteration handles: [CHUNK, experts] one-hot tiles
# Guesses to be measured on the GPU (python -m omni_local.bench.moe_layer --sort): the one program
# costs about a loop iteration per pass per CHUNK pairs, the chunked sort three launches whatever
# the count; 512 pairs (64 tokens at top-8) is where they should meet. Chunks of 256 pairs give a
# 2,048-token prefill's 16,384 pairs 64 programs of four iterations each, fewer than an H200's 132 SMs.
CHUNKED_FROM_PAIRS = 512
CHUNK_PAIRS = 256
CHUNK_ROWS = 32  # chunks one iteration of the offsets program handles: [CHUNK_ROWS, experts] tiles


@triton.jit(do_not_specialize=["pairs", "rows"])
def _sort_kernel(experts_ptr, sorted_ptr, pairs, rows, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                 CHUNK: tl.constexpr):
    sort_pairs(experts_ptr, sorted_ptr, pairs, rows, BLOCK_M, BLOCK_E, CHUNK)


@triton.jit
def sort_pairs(experts_ptr, sorted_ptr, pairs, rows, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
               CHUNK: tl.constexpr):
    """The one-program sort: every pair's row, the padding first (route_and_sort.py calls it too)."""
    lanes = tl.arange(0, CHUNK)
    expert_ids = tl.arange(0, BLOCK_E)
    for start in range(0, rows, CHUNK):
        tl.store(sorted_ptr + start + lanes, pairs, mask=start + lanes < rows)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        expert = tl.load(experts_ptr + start + lanes, mask=start + lanes < pairs, other=BLOCK_E)
        counts += tl.sum((expert[:, None] == expert_ids[None, :]).to(tl.int32), axis=0)
    next_row = _run_starts(counts, BLOCK_M)
    # The padding must be written before any pair lands on its row.
    tl.debug_barrier()
    for start in range(0, pairs, CHUNK):
        next_row = _scatter(experts_ptr, sorted_ptr, start, pairs, next_row, BLOCK_E, CHUNK)


@triton.jit
def _run_starts(counts, BLOCK_M: tl.constexpr):
    """Each expert's first row [BLOCK_E], for its pair `counts`: the runs in expert order, each
    padded to whole blocks."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return tl.cumsum(padded, axis=0) - padded


@triton.jit
def _scatter(experts_ptr, sorted_ptr, start, pairs, next_row, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs [start, start + CHUNK) to their rows, from each expert's `next_row` [BLOCK_E] on (the
    earlier of one expert's pairs first); the next rows after them."""
    pair = start + tl.arange(0, CHUNK)
    expert = tl.load(experts_ptr + pair, mask=pair < pairs, other=BLOCK_E)
    hits = (expert[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
    earlier_in_chunk = tl.sum(tl.cumsum(hits, axis=0) * hits, axis=1) - 1
    row = tl.sum(hits * next_row[None, :], axis=1) + earlier_in_chunk
    tl.store(sorted_ptr + row, pair, mask=pair < pairs)
    return next_row + tl.sum(hits, axis=0)


@triton.jit(do_not_specialize=["pairs", "rows"])
def _count_kernel(experts_ptr, sorted_ptr, counts_ptr, pairs, rows,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_PAIRS: tl.constexpr):
    # Program c: the padding over rows [c * CHUNK_PAIRS, (c + 1) * CHUNK_PAIRS) (the grid covers
    # every row), and counts[c] [BLOCK_E], chunk c's pairs per expert (where chunk c has pairs).
    first = tl.program_id(0) * CHUNK_PAIRS
    lanes = tl.arange(0, CHUNK)
    expert_ids = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(first, first + CHUNK_PAIRS, CHUNK):
        tl.store(sorted_ptr + start + lanes, pairs, mask=start + lanes < rows)
        expert = tl.load(experts_ptr + start + lanes, mask=start + lanes < pairs, other=BLOCK_E)
        counts += tl.sum((expert[:, None] == expert_ids[None, :]).to(tl.int32), axis=0)
    if first < pairs:
        tl.store(counts_ptr + tl.program_id(0) * BLOCK_E + expert_ids, counts)


@triton.jit(do_not_specialize=["chunks"])
def _offsets_kernel(counts_ptr, offsets_ptr, chunks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    CHUNK_ROWS: tl.constexpr):
    # One program: offsets[c, e], the row of chunk c's first pair of expert e, is expert e's run
    # start plus the pairs of e in chunks before c.
    expert_ids = tl.arange(0, BLOCK_E)
    chunk_ids = tl.arange(0, CHUNK_ROWS)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, chunks, CHUNK_ROWS):
        at = (start + chunk_ids)[:, None] * BLOCK_E + expert_ids[None, :]
        counts = tl.load(counts_ptr + at, mask=(start + chunk_ids < chunks)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
    next_row = _run_starts(totals, BLOCK_M)
    for start in range(0, chunks, CHUNK_ROWS):
        at = (start + chunk_ids)[:, None] * BLOCK_E + expert_ids[None, :]
        inside = (start + chunk_ids < chunks)[:, None]
        counts = tl.load(counts_ptr + at, mask=inside, other=0)
        tl.store(offsets_ptr + at, next_row[None, :] + tl.cumsum(counts, axis=0) - counts, mask=inside)
        next_row += tl.sum(counts, axis=0)


@triton.jit(do_not_specialize=["pairs"])
def _scatter_kernel(experts_ptr, sorted_ptr, offsets_ptr, pairs,
                    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_PAIRS: tl.constexpr):
    # Program c: chunk c's pairs to their rows, from offsets[c] on.
    first = tl.program_id(0) * CHUNK_PAIRS
    next_row = tl.load(offsets_ptr + tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E))
    for start in range(first, first + CHUNK_PAIRS, CHUNK):
        next_row = _scatter(experts_ptr, sorted_ptr, start, pairs, next_row, BLOCK_E, CHUNK)


@triton.jit
def sorted_block(sorted_ptr, experts_ptr, pairs, BLOCK_M: tl.constexpr):
    """For the GEMM program of block `program_id(0)`: its first pair (`pairs` for a block past the last
    expert's, which has nothing to do), its expert (int64), its pairs [BLOCK_M], and which are real."""
    rows = sorted_ptr + tl.program_id(0) * BLOCK_M
    first = tl.load(rows)
    expert = tl.load(experts_ptr + first, mask=first < pairs, other=0).to(tl.int64)
    pair = tl.load(rows + tl.arange(0, BLOCK_M))
    return first, expert, pair, pair < pairs


def sorted_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sort writes: every pair, plus the most padding its experts can need (at most
    min(pairs, experts) runs are padded, each by under a block), in whole blocks."""
    bound = pairs + min(pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def sorts_in_chunks(pairs: int) -> bool:
    """Whether `sort_by_expert` sorts this many pairs in chunks (else in one program)."""
    return pairs >= CHUNKED_FROM_PAIRS


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """Pair indices [sorted_rows] int32, grouped by expert in blocks of `block_m` rows, for the
    experts [tokens, top_k] each token is routed to; padding rows hold the pair count."""
    if sorts_in_chunks(experts.numel()):
        return sort_in_chunks(experts, num_experts, block_m, CHUNK_PAIRS)
    return sort_in_one_program(experts, num_experts, block_m)


def sort_in_one_program(experts: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """`sort_by_expert` in one single-program launch."""
    pairs = experts.numel()
    rows = sorted_rows(pairs, num_experts, block_m)
    order = torch.empty(rows, dtype=torch.int32, device=experts.device)
    _sort_kernel[(1,)](experts, order, pairs, rows, BLOCK_M=block_m,
                       BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK, num_warps=4)
    return order


def sort_in_chunks(experts: torch.Tensor, num_experts: int, block_m: int, chunk_pairs: int) -> torch.Tensor:
    """`sort_by_expert` in three launches over chunks of `chunk_pairs` pairs (a power of two)."""
    pairs = experts.numel()
    rows = sorted_rows(pairs, num_experts, block_m)
    block_e, chunk = triton.next_power_of_2(num_experts), min(CHUNK, chunk_pairs)
    chunks = triton.cdiv(pairs, chunk_pairs)
    order = torch.empty(rows, dtype=torch.int32, device=experts.device)
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=experts.device)
    offsets = torch.empty_like(counts)
    _count_kernel[(triton.cdiv(rows, chunk_pairs),)](experts, order, counts, pairs, rows, BLOCK_E=block_e,
                                                     CHUNK=chunk, CHUNK_PAIRS=chunk_pairs, num_warps=4)
    _offsets_kernel[(1,)](counts, offsets, chunks, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK_ROWS=CHUNK_ROWS,
                          num_warps=4)
    _scatter_kernel[(chunks,)](experts, order, offsets, pairs, BLOCK_E=block_e, CHUNK=chunk,
                               CHUNK_PAIRS=chunk_pairs, num_warps=4)
    return order
