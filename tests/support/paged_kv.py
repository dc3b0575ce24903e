"""The paged KV the attention tests run on: the same random KV contiguous and paged through a
scrambled block table, NaN wherever no sequence's row is; the cases of new tokens over it, on tiny
shapes and at the Thinker's full size; and our kernel's or the reference's call on it.
(tests/kernels/test_paged_attention.py, tests/engine/test_fp8_kv.py.)"""

from dataclasses import dataclass

import pytest
import torch

from device_under_test import TEST_DEVICE
from omni_local.kernels.attention.paged import DECODE_SPLIT_ROWS, MAX_DECODE_SPLITS, SPLIT_ROWS

on_cpu = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")
on_gpu = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")

FLOAT32 = dict(rtol=1e-5, atol=1e-5)
FLOAT16 = dict(rtol=1e-3, atol=1e-3)
BLOCK_SIZE, HEAD_DIM, SCALING = 16, 16, 0.25


@dataclass
class PagedKV:
    """The same KV two ways: contiguous [B, kv_heads, rows, head_dim], and paged in pools through a
    block table whose block ids are scrambled."""

    keys: torch.Tensor
    values: torch.Tensor
    key_pool: torch.Tensor
    value_pool: torch.Tensor
    block_tables: torch.Tensor


def paged_kv(lengths: list[int], kv_heads: int, dtype: torch.dtype, width: int | None = None,
             filler: float = float("nan"), table_dtype: torch.dtype = torch.int32, device: str = "cpu",
             head_dim: int = HEAD_DIM, seed: int = 0) -> PagedKV:
    """Random KV for sequences of `lengths` rows, paged into blocks in a shuffled order among as many
    unused ones; every pool row that is no sequence's holds `filler`. Table rows are `width` blocks
    (default: the longest sequence's), their entries past a sequence's end an unused block."""
    generator = torch.Generator(device).manual_seed(seed)
    needed = [-(-n // BLOCK_SIZE) for n in lengths]
    width = width or max(needed)
    rows = width * BLOCK_SIZE
    shape = (len(lengths), kv_heads, rows, head_dim)
    keys = torch.randn(shape, generator=generator, device=device).to(dtype)
    values = torch.randn(shape, generator=generator, device=device).to(dtype)
    num_blocks = 2 * sum(needed) + 1
    order = torch.randperm(num_blocks, generator=generator, device=device)
    unused = order[-1]
    key_pool = torch.full((num_blocks, kv_heads, BLOCK_SIZE, head_dim), filler, dtype=dtype, device=device)
    value_pool = key_pool.clone()
    tables = torch.full((len(lengths), width), int(unused), dtype=table_dtype, device=device)
    taken = 0
    for b, (length, count) in enumerate(zip(lengths, needed)):
        blocks = order[taken : taken + count]
        tables[b, :count] = blocks.to(table_dtype)
        taken += count
        for pool, contiguous in ((key_pool, keys), (value_pool, values)):
            own = contiguous[b, :, : count * BLOCK_SIZE].clone()
            own[:, length:] = filler
            pool[blocks] = own.view(kv_heads, count, BLOCK_SIZE, head_dim).transpose(0, 1)
    return PagedKV(keys, values, key_pool, value_pool, tables)


def new_tokens(heads: int, query_rows: list[list[int]], dtype: torch.dtype, device: str = "cpu",
               head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """(query [B, heads, L, head_dim], query_rows [B, L] int64) for new tokens at `query_rows`."""
    rows = torch.tensor(query_rows, device=device)
    generator = torch.Generator(device).manual_seed(1)
    query = torch.randn((len(query_rows), heads, rows.shape[1], head_dim), generator=generator, device=device)
    return query.to(dtype), rows


def tail(start: int, length: int) -> list[int]:
    """The rows of `length` new tokens after `start` cached ones."""
    return list(range(start, start + length))


# More rows than the most splits of the fewest rows hold: a decode step splits them in longer runs.
LONG_DECODE_ROWS = DECODE_SPLIT_ROWS * MAX_DECODE_SPLITS + 77

CASES = {  # (heads, kv_heads, each sequence's new tokens' rows)
    "one decode token, its sequence shorter than a block": (4, 2, [[4]]),
    "decode tokens of sequences of uneven lengths": (4, 2, [[2], [39], [16], [31]]),
    "a group of 8 query heads per kv head, as the Thinker's": (8, 1, [[20], [7]]),
    "one query head per kv head": (2, 2, [[9], [33]]),
    "a group of 3 query heads per kv head, not a power of two": (6, 2, [[12], [40]]),
    "sequences on both sides of a split boundary": (4, 2, [[SPLIT_ROWS - 1], [SPLIT_ROWS], [SPLIT_ROWS + 40]]),
    "a decode token whose rows need longer splits than the fewest, beside a short one": (
        4, 2, [[LONG_DECODE_ROWS - 1], [DECODE_SPLIT_ROWS + 3]]),
    "causal tails of new tokens on cached prefixes, one empty": (4, 2, [tail(30, 5), tail(0, 5), tail(11, 5)]),
    "a short tail on a prefix longer than a split, beside a tail in one split": (4, 2, [tail(SPLIT_ROWS + 40, 5),
                                                                                   tail(3, 5)]),
    "a tail of two query tiles in the Thinker's group of 8": (8, 1, [tail(20, 9)]),
    "a tail padded by repeating its last row, as a CUDA graph pads it": (4, 2, [[17, 18, 19, 19, 19]]),
}


def case_inputs(case: str, dtype: torch.dtype, **options) -> tuple[torch.Tensor, torch.Tensor, PagedKV]:
    heads, kv_heads, rows = CASES[case]
    query, query_rows = new_tokens(heads, rows, dtype)
    kv = paged_kv([max(r) + 1 for r in rows], kv_heads, dtype, **options)
    return query, query_rows, kv


def paged_call(attention, query: torch.Tensor, kv: PagedKV, query_rows: torch.Tensor, **options) -> torch.Tensor:
    return attention(query, kv.key_pool, kv.value_pool, kv.block_tables, query_rows, SCALING, **options)


# The Thinker's attention (../shared/model-configs/qwen3-omni-30b-a3b-instruct.json), in bfloat16.
HEADS, KV_HEADS, FULL_HEAD_DIM = 32, 4, 128


def full_size(batch: int, context: int, length: int = 1) -> tuple[torch.Tensor, torch.Tensor, PagedKV]:
    """`length` new tokens (a decode step's one, or a tail) of `batch` sequences of uneven lengths up
    to `context` rows, a table `context` rows wide (the graph bucket's), at the Thinker's size in
    bfloat16 on the GPU."""
    lengths = [context - (37 * b) % 200 for b in range(batch)]
    query, query_rows = new_tokens(HEADS, [tail(n - length, length) for n in lengths], torch.bfloat16,
                                   device="cuda", head_dim=FULL_HEAD_DIM)
    kv = paged_kv(lengths, KV_HEADS, torch.bfloat16, width=context // BLOCK_SIZE, device="cuda",
                  head_dim=FULL_HEAD_DIM)
    return query, query_rows, kv
