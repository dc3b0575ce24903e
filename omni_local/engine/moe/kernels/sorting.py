"""The (token, k) pairs sorted by expert into blocks of BLOCK_M rows, in one single-program launch.

Pair p = token * top_k + k is routed to expert `experts[p]`. Each expert's pairs take consecutive
rows, in pair order (a stable sort, so the layout depends only on the routing), and its run is
padded to a whole number of blocks, so every block belongs to one expert and its first row is a
real pair. Padding rows, and the blocks past the last expert's, hold `pairs` (out of range). The
output's size depends only on the pair count (`sorted_rows`), so a CUDA graph captures it, and
nothing is read back to the host.
"""

import torch
import triton
import triton.language as tl

CHUNK = 64  # pairs (or rows) one loop iteration handles: [CHUNK, experts] one-hot tiles


@triton.jit
def _sort_kernel(experts_ptr, sorted_ptr, pairs, num_experts, rows,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    lanes = tl.arange(0, CHUNK)
    expert_ids = tl.arange(0, BLOCK_E)
    for start in range(0, rows, CHUNK):
        tl.store(sorted_ptr + start + lanes, pairs, mask=start + lanes < rows)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        expert = tl.load(experts_ptr + start + lanes, mask=start + lanes < pairs, other=BLOCK_E)
        counts += tl.sum((expert[:, None] == expert_ids[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    next_row = tl.cumsum(padded, axis=0) - padded  # each expert's first row
    # The padding must be written before any pair lands on its row.
    tl.debug_barrier()
    for start in range(0, pairs, CHUNK):
        pair = start + lanes
        expert = tl.load(experts_ptr + pair, mask=pair < pairs, other=BLOCK_E)
        hits = (expert[:, None] == expert_ids[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        earlier_in_chunk = tl.sum(tl.cumsum(hits, axis=0) * hits, axis=1) - 1
        row = tl.sum(hits * next_row[None, :], axis=1) + earlier_in_chunk
        tl.store(sorted_ptr + row, pair, mask=pair < pairs)
        next_row += tl.sum(hits, axis=0)


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


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """Pair indices [sorted_rows] int32, grouped by expert in blocks of `block_m` rows, for the
    experts [tokens, top_k] each token is routed to; padding rows hold the pair count."""
    pairs = experts.numel()
    rows = sorted_rows(pairs, num_experts, block_m)
    order = torch.empty(rows, dtype=torch.int32, device=experts.device)
    _sort_kernel[(1,)](experts, order, pairs, num_experts, rows, BLOCK_M=block_m,
                       BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK, num_warps=4)
    return order
