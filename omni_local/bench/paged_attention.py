"""One decode step's attention for one layer, three ways, against chats and context:

- slots: the engine's graphed path before the KV was paged (commit 68666bc and earlier): each chat's
  KV slot's first `context` rows copied out of [slots, kv_heads, max_tokens, head_dim] by
  index_select, then SDPA under a boolean mask;
- gathered: `gathered_attention`, the blocks of a paged KV gathered, then the same SDPA;
- paged: `paged_attention`, our Triton kernel reading the blocks in place, its KV walk split in runs
  of DECODE_SPLIT_ROWS rows or more (kernels/attention/paged.py); with --split-rows N ..., also the
  kernel with runs of N rows or more, a column each (a split is the rows one program walks: more
  programs for a short context, more partial results to merge for a long one).

    python -m omni_local.bench.paged_attention                                     # on a GPU
    python -m omni_local.bench.paged_attention --split-rows 128 256                # longer runs too
    TRITON_INTERPRET=1 python -m omni_local.bench.paged_attention --device cpu     # smoke run

On a GPU: the Thinker's attention (32 heads, 4 kv heads, head_dim 128) in bfloat16, blocks of 16
rows, each call captured in a CUDA graph and replayed, the median of --runs CUDA-event-timed
replays with the L2 cache flushed before each; also times 48 (the Thinker's layers: a step's
cost). On the CPU: tiny shapes, eager, wall time, the kernel in Triton's interpreter; it checks
the script runs, its times mean nothing.
"""

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_local.bench.common import median_wall_ms
from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.engine.forward.cuda_graphs import capture_graph
from omni_local.engine.memory.attention import gathered_attention
from omni_local.engine.memory.attention.reference import grouped_sdpa
from omni_local.kernels.attention.paged import BLOCK_N, paged_attention

BATCHES = [1, 2, 4, 8, 16]
CONTEXTS = [256, 1024, 4096]
LAYERS = 48  # the Thinker's decoder layers


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16


# Qwen3-Omni-30B-A3B's Thinker (../shared/model-configs/qwen3-omni-30b-a3b-instruct.json)
THINKER = AttentionShape(heads=32, kv_heads=4, head_dim=128)
TINY = AttentionShape(heads=4, kv_heads=2, head_dim=16)  # the CPU smoke run's


@dataclass(frozen=True)
class DecodeInputs:
    """One decode token per chat at row `context - 1`, its KV in a slot store and in block pools."""

    query: torch.Tensor  # [B, heads, 1, head_dim]
    query_rows: torch.Tensor  # [B, 1]
    slot_keys: torch.Tensor  # [slots, kv_heads, max_tokens, head_dim]
    slot_values: torch.Tensor
    kv_slots: torch.Tensor  # [B]
    key_pool: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    value_pool: torch.Tensor
    block_tables: torch.Tensor  # [B, context / block_size] int32, block ids shuffled
    context: int


def decode_inputs(shape: AttentionShape, batch: int, context: int, max_tokens: int, dtype: torch.dtype,
                  device: str) -> DecodeInputs:
    """Random KV (its values do not change the times) for `batch` chats of `context` rows."""
    def kv(*size: int) -> torch.Tensor:
        return torch.randn(size, dtype=dtype, device=device)

    width = context // shape.block_size
    order = torch.randperm(batch * width, device=device)
    return DecodeInputs(
        query=kv(batch, shape.heads, 1, shape.head_dim),
        query_rows=torch.full((batch, 1), context - 1, device=device),
        slot_keys=kv(batch, shape.kv_heads, max_tokens, shape.head_dim),
        slot_values=kv(batch, shape.kv_heads, max_tokens, shape.head_dim),
        kv_slots=torch.arange(batch, device=device),
        key_pool=kv(batch * width, shape.kv_heads, shape.block_size, shape.head_dim),
        value_pool=kv(batch * width, shape.kv_heads, shape.block_size, shape.head_dim),
        block_tables=order.view(batch, width).to(torch.int32),
        context=context,
    )


def slots(x: DecodeInputs, scaling: float) -> torch.Tensor:
    """The slots' first rows copied, as the graphs' cache writer did before paging, then transformers'
    masked SDPA."""
    keys = x.slot_keys[:, :, : x.context].index_select(0, x.kv_slots)
    values = x.slot_values[:, :, : x.context].index_select(0, x.kv_slots)
    allowed = torch.arange(x.context, device=keys.device)[None, None, None, :] <= x.query_rows[:, None, :, None]
    return grouped_sdpa(x.query, keys, values, allowed, scaling)


def gathered(x: DecodeInputs, scaling: float) -> torch.Tensor:
    return gathered_attention(x.query, x.key_pool, x.value_pool, x.block_tables, x.query_rows, scaling)


def paged(x: DecodeInputs, scaling: float) -> torch.Tensor:
    return paged_attention(x.query, x.key_pool, x.value_pool, x.block_tables, x.query_rows, scaling)


WAYS = {"slots": slots, "gathered": gathered, "paged": paged}


def ways(split_rows: list[int]) -> dict[str, Callable[[DecodeInputs, float], torch.Tensor]]:
    """WAYS, then the kernel with splits of N rows or more for each N of `split_rows`."""
    def split(n: int) -> Callable[[DecodeInputs, float], torch.Tensor]:
        return lambda x, scaling: paged_attention(x.query, x.key_pool, x.value_pool, x.block_tables, x.query_rows,
                                                  scaling, decode_split_rows=n)
    return WAYS | {f"paged, splits of {n}+": split(n) for n in split_rows}


def median_us(call: Callable[[], object], device: str, runs: int) -> float:
    """On a GPU, a CUDA graph of `call` replayed; elsewhere `call` itself, wall time."""
    if device != "cuda":
        return median_wall_ms(call, runs) * 1e3
    graph, _ = capture_graph(call, torch.cuda.graph_pool_handle())
    return median_cuda_ms(graph.replay, runs) * 1e3


def row(shape: AttentionShape, batch: int, context: int, max_tokens: int, dtype: torch.dtype, device: str,
        runs: int, timed: dict[str, Callable[[DecodeInputs, float], torch.Tensor]]) -> list[float]:
    """Each of the `timed` ways' median µs for `batch` chats at `context` rows."""
    x = decode_inputs(shape, batch, context, max_tokens, dtype, device)
    scaling = shape.head_dim ** -0.5
    return [median_us(lambda way=way: way(x, scaling), device, runs) for way in timed.values()]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.paged_attention")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chats", type=int, nargs="+", help=f"rows of the table (default {BATCHES}; CPU: 1 2)")
    parser.add_argument("--contexts", type=int, nargs="+",
                        help=f"columns, multiples of 16 rows (default {CONTEXTS}; CPU: 32 272)")
    parser.add_argument("--runs", type=int, default=200, help="timed calls per cell")
    parser.add_argument("--split-rows", type=int, nargs="+", default=[],
                        help=f"also time the kernel with splits of N rows or more (multiples of {BLOCK_N})")
    args = parser.parse_args()
    if any(n <= 0 or n % BLOCK_N for n in args.split_rows):
        parser.error(f"--split-rows: multiples of {BLOCK_N}")
    on_gpu = args.device == "cuda"
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on the CPU the kernel runs in Triton's interpreter: set TRITON_INTERPRET=1")
    shape, dtype = (THINKER, torch.bfloat16) if on_gpu else (TINY, torch.float32)
    chats = args.chats or (BATCHES if on_gpu else [1, 2])
    contexts = args.contexts or (CONTEXTS if on_gpu else [32, 272])  # 272: five 64-row splits, two of 256
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (smoke run: the times mean nothing)"
    print(f"decode attention, one layer: {shape.heads} heads, {shape.kv_heads} kv heads, head_dim "
          f"{shape.head_dim}, blocks of {shape.block_size}, {dtype}, {device_name}; median µs of {args.runs}"
          f"{', CUDA graphs' if on_gpu else ''}; x{LAYERS}: ms per step\n")
    timed = ways(args.split_rows)
    names = list(timed)
    print(f"| chats | context | {' | '.join(f'{n} (µs)' for n in names)} | "
          f"{' | '.join(f'{n} x{LAYERS} (ms)' for n in names)} | paged speed-up |")
    print("| --- |" + " --- |" * (2 * len(names) + 2))
    for batch in chats:
        for context in contexts:
            times = row(shape, batch, context, max(contexts), dtype, args.device, args.runs, timed)
            per_step = " | ".join(f"{t * LAYERS / 1e3:.3f}" for t in times)
            paged_us = times[names.index("paged")]
            print(f"| {batch} | {context} | {' | '.join(f'{t:.1f}' for t in times)} | {per_step} | "
                  f"{times[0] / paged_us:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
