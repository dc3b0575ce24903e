"""Forwards captured as CUDA graphs: decode steps and prefills of a decoder stack over a
batch of sequences, each in its own blocks of a KVStore, the Thinker's or the Talker's (BatchGraphs),
and forwards of fixed shapes such as the code predictor's 15 steps of a frame (StaticGraph).

Eager, a forward of transformers' modules is bound by kernel launches and host work (80 to 120 ms
for the Thinker's decode step or a 25-token prefill, 41 ms for the Talker's step at full size on an
H200); replaying the same kernels as a graph takes about 13, 19 and 5 ms. BatchGraphs captures one
graph per shape bucket: the batch (chats decoding together), the new tokens per chat (a prefill's
length, padded), and the attention length (each graph reads only the sequences' first `rows` rows, so
a short chat does not attend over a whole context; a prefill that begins its sequence reads none but
its own, in a graph of its own; a longer prefill under our kernel, which reads only its own tokens'
rows, has one bucket). Each batch row's block table, where its new rows go, its positions
and inputs are device tensors the graphs read when they replay: one graph serves every sequence and
position. The graphs go into one memory pool per owner (its graphs never replay at the same time),
captured at start-up (`capture`), or some after it: the engine captures its prefill graphs once it
serves, one at a time while it is idle (`capture(table, 1)`), a call with none yet running eagerly.
"""

import gc
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch

from omni_local.engine.memory.attention import PagedAttention
from omni_local.engine.memory.host_copies import copy_from_host
from omni_local.engine.memory.kv_blocks import PAD_BLOCK
from omni_local.engine.memory.kv_store import NO_PREFIX, BlockTable, GraphedKVWriter, KVStore

# What a forward returns: a tensor, or a tuple of them (the Talker's hidden state and logits).
Outputs = torch.Tensor | tuple[torch.Tensor, ...]
# (cache, input [B, L] token ids or [B, L, hidden] embeddings, positions [3, B, L]) -> outputs,
# each with B first; the same function runs eager with B = 1.
BatchForward = Callable[[GraphedKVWriter, torch.Tensor, torch.Tensor], Outputs]

SMALLEST_BUCKET = 256


def attention_buckets(max_tokens: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET, then `max_tokens` itself: at most twice the rows needed."""
    return size_buckets(SMALLEST_BUCKET, max_tokens)


def size_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` while below `largest`, then `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return [*buckets, largest]


def prefill_lengths(chunk_tokens: int, forward_tokens: int) -> list[int]:
    """The prefill graphs' lengths: powers of two from 16 to `chunk_tokens` (a chunk, a question, a
    small image: padded to at most twice its tokens), then four to each doubling up to
    `forward_tokens` (a long prompt's forward: padded by at most a quarter, as its cost grows with its
    tokens once it reads every MoE expert's weights)."""
    lengths = size_buckets(16, chunk_tokens)
    while lengths[-1] < forward_tokens:
        step = 1 << max(4, (lengths[-1] // 4).bit_length() - 1)  # a power of two, at most a quarter of it
        lengths.append(min(lengths[-1] + step, forward_tokens))
    return lengths


def graphable(stack_config: Any, device: torch.device) -> bool:
    """Whether BatchGraphs can run a forward of a stack with this config: on CUDA, under an attention
    that takes the bucket's mask (flash attention takes none)."""
    return device.type == "cuda" and stack_config._attn_implementation in ("sdpa", "eager")


class BatchGraphs:
    """`forward` captured for every (batch, length, rows) bucket (`capture`), and replayed from the
    smallest that holds a call once captured. `input_like` is one token's input ([1, 1] ids or [1, 1,
    hidden] embeddings); each capture runs inside a context `capturable()` makes, where the stack's
    MoE experts can be captured (`MoeBackend.capturable`). With a `kernel`, attention reads the
    blocks in place (decode steps, prefills on a prefix), and prefills of new tokens that begin their
    sequences too unless not `kernel_from_start`; else the bucket's rows are gathered for
    transformers' attention.

    A call with fewer sequences than its batch bucket is padded with copies of its first sequence
    (their writes are that sequence's own, the same values to the same rows); a shorter prefill with
    zero inputs after its own, written to the rows after its end (in its blocks, or past them in the
    pad block), which later steps read only masked and the next write there replaces.
    """

    def __init__(self, forward: BatchForward, store: KVStore, input_like: torch.Tensor,
                 capturable: Callable[[], AbstractContextManager[None]], batches: Sequence[int] = (1,),
                 lengths: Sequence[int] = (1,), pool: tuple | None = None,
                 kernel: PagedAttention | None = None, kernel_from_start: bool = True) -> None:
        self.store, self.batches, self.lengths = store, list(batches), list(lengths)
        self.buckets = attention_buckets(store.shape.max_tokens)
        b, n, width = max(batches), max(lengths), store.shape.table_blocks
        device = store.device
        self._input = input_like.new_zeros((b, n, *input_like.shape[2:]))  # static: copied into before each replay
        self._positions = torch.zeros((3, b, n), dtype=torch.long, device=device)
        # indices, blocks and offsets [b, n], tables [b, width], last [b]: filled from the host by one
        # non-blocking copy per replay (the input and the positions are copied on the device)
        self._layout = torch.zeros(3 * b * n + b * width + b, dtype=torch.long, device=device)
        self._indices, self._blocks, self._offsets = self._layout[: 3 * b * n].view(3, b, n)
        self._tables = self._layout[3 * b * n : 3 * b * n + b * width].view(b, width)
        self._last = self._layout[3 * b * n + b * width :]
        self._forward, self._capturable, self._kernel = forward, capturable, kernel
        self._pool = pool or torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self._rows = {length: self._rows_buckets(length, kernel) for length in self.lengths}
        self._from_start = kernel is not None and kernel_from_start
        # Largest first: the smaller ones reuse its pool memory.
        self._uncaptured = [(batch, length, rows) for batch in reversed(self.batches)
                            for length in reversed(self.lengths)
                            for rows in [*reversed(self._rows[length]), *self._no_prefix(length, self._from_start)]]

    @property
    def uncaptured(self) -> int:
        """How many graphs are still to capture."""
        return len(self._uncaptured)

    def capture(self, table: BlockTable, count: int | None = None) -> None:
        """Capture the next `count` graphs (all that are left by default), writing into the first
        block of `table`, which the caller holds and nobody reads. The buffers are reset first: a
        capture runs its forward once eagerly, and what the last replay left there (another chat's
        blocks, a poisoned input's NaNs) must not reach it."""
        self._input.zero_()
        self._positions.zero_()
        self._layout.zero_()
        self._tables.copy_(self._filled_tables([table[:1]] * self._tables.shape[0]))
        self._blocks.fill_(table[0])
        with self._capturable():
            for batch, length, rows in self._uncaptured[:count]:
                cache = GraphedKVWriter(self.store, self._tables[:batch], self._indices[:batch, :length],
                                        self._blocks[:batch, :length], self._offsets[:batch, :length],
                                        self._last[:batch], rows, None if rows == NO_PREFIX else self._kernel)
                run = partial(self._forward, cache, self._input[:batch, :length], self._positions[:, :batch, :length])
                self._graphs[batch, length, rows] = capture_graph(run, self._pool)
        del self._uncaptured[:count]

    def give_up(self) -> None:
        """Capture no more: calls whose graph is not captured run without one."""
        self._uncaptured.clear()

    def _rows_buckets(self, length: int, kernel: PagedAttention | None) -> list[int]:
        """The attention buckets graphs of `length` new tokens are captured for: each that holds them
        (a prefill padded to `length` tokens is more than half new tokens: fewer rows never hold it)
        where the rows a graph reads set its work, under transformers' attention (the bucket
        gathered) and the kernel's split walks; else the largest alone, as the kernel's programs of a
        longer tail walk only their own rows, and more graphs only take start-up time and memory."""
        holding = [rows for rows in self.buckets if rows >= length]
        if kernel is None:
            return holding
        from omni_local.kernels.attention.paged import grid_follows_rows  # imports triton, as the kernel has

        return holding if grid_follows_rows(length) else holding[-1:]

    @staticmethod
    def _no_prefix(length: int, kernel_attends_first: bool) -> list[int]:
        """[NO_PREFIX] where a graph for new tokens that begin their sequences is worth capturing: a
        prefill's, attending as transformers does (not where the kernel attends for them, reading
        the blocks anyway)."""
        return [NO_PREFIX] if length > 1 and not kernel_attends_first else []

    def fits(self, batch: int, length: int, start: int) -> bool:
        """Whether a call of `batch` sequences of `length` new tokens after `start` rows has a graph
        (its padded rows within a sequence's most), captured."""
        return self._bucket(batch, length, start) in self._graphs

    def bucket(self, count: int, length: int, start: int) -> tuple[int, int, int]:
        """The (batch, length, rows) of the graph that runs `count` sequences of `length` new tokens
        after `start` rows at most (rows NO_PREFIX where they begin their sequences)."""
        key = self._bucket(count, length, start)
        if key is None:
            raise IndexError(f"no graph for {count} sequences of {length} new tokens after row {start}")
        return key

    def _bucket(self, count: int, length: int, start: int) -> tuple[int, int, int] | None:
        padded = next((n for n in self.lengths if length <= n), None)
        if count > self.batches[-1] or padded is None or start + padded > self.store.shape.max_tokens:
            return None
        batch = next(b for b in self.batches if count <= b)
        if start == 0 and self._no_prefix(padded, self._from_start):
            return batch, padded, NO_PREFIX
        return batch, padded, next(r for r in self._rows[padded] if start + length <= r)

    def replay(self, tables: list[BlockTable], x: torch.Tensor, starts: list[int], positions: torch.Tensor) -> Outputs:
        """The forward's outputs for input `x` ([B, n] or [B, n, hidden]) at `positions` [3, B, n],
        both on the device, sequence i's new tokens written from row `starts[i]` of block table
        `tables[i]`; outputs for the B sequences, first. Check `fits` first."""
        count, length = x.shape[0], x.shape[1]
        batch, padded, rows = self.bucket(count, length, max(starts))
        # Nothing here waits for the device: `x` and `positions` are copied on it, and so are the
        # padding sequences (copies of the first); the layout goes from the host without blocking.
        pad = batch - count
        self._input[:count, :length].copy_(x)
        self._input[count:batch, :length].copy_(x[:1].expand(pad, *x.shape[1:]))
        # The padding tokens' inputs are zeros, never an earlier call's (a poisoned one's may be NaN):
        # their KV rows lie past the chat's end, inside the buckets later steps read (masked), so they
        # must be numbers. A decode step is never padded.
        if padded > length:
            self._input[:batch, length:padded].zero_()
        self._positions[:, :count, :length].copy_(positions)
        self._positions[:, count:batch, :length].copy_(positions[:, :1].expand(-1, pad, -1))
        # A padded prefill's extra tokens take the last real position: any valid one would do.
        last = self._positions[:, :batch, length - 1 : length]
        self._positions[:, :batch, length:padded].copy_(last.expand(-1, -1, padded - length))
        copy_from_host(self._layout, self._host_layout(tables + tables[:1] * pad, starts + starts[:1] * pad,
                                                       padded, length))
        graph, outputs = self._graphs[batch, padded, rows]
        graph.replay()
        return cloned(outputs, count)

    def _host_layout(self, tables: list[BlockTable], starts: list[int], padded: int, length: int) -> torch.Tensor:
        """The layout buffer's contents, built on the host: each sequence's `padded` rows from its
        start, where each is in the pool, its block table, and its last real token."""
        size = self.store.shape.block_tokens
        filled = self._filled_tables(tables)
        indices = torch.zeros(self._indices.shape, dtype=torch.long)
        indices[: len(starts), :padded] = torch.tensor(starts)[:, None] + torch.arange(padded)
        # A padding token past a sequence's blocks is written to the pad block, which the table holds there.
        blocks = filled.gather(1, (indices // size).clamp(max=filled.shape[1] - 1))
        return torch.cat([indices.flatten(), blocks.flatten(), (indices % size).flatten(), filled.flatten(),
                          torch.full(self._last.shape, length - 1)])

    def _filled_tables(self, tables: list[BlockTable]) -> torch.Tensor:
        """[b, width] of `tables` on the host, each padded with the pad block."""
        filled = torch.full(self._tables.shape, PAD_BLOCK, dtype=torch.long)
        for row, table in enumerate(tables):
            filled[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        return filled


class StaticGraph:
    """`forward(*inputs)` captured once, over static buffers shaped like `inputs`: a forward whose
    shapes never change, such as the code predictor's 15 steps of a frame of a batch of replies.
    `pool`: a memory pool it shares with graphs that never run at the same time (captured largest
    first); a pool of its own by default."""

    def __init__(self, forward: Callable[..., Outputs], inputs: list[torch.Tensor], pool: tuple | None = None) -> None:
        self._inputs = [torch.zeros_like(x) for x in inputs]  # copied into before each replay
        self._graph, self._outputs = capture_graph(partial(forward, *self._inputs),
                                                   pool if pool is not None else torch.cuda.graph_pool_handle())

    def replay(self, *inputs: torch.Tensor) -> Outputs:
        captured = [(x.shape, x.dtype) for x in self._inputs]
        if [(x.shape, x.dtype) for x in inputs] != captured:
            raise ValueError(f"the graph was captured for inputs {captured}, not these")  # copy_ would broadcast
        for buffer, x in zip(self._inputs, inputs):
            buffer.copy_(x)
        self._graph.replay()
        return cloned(self._outputs)


def capture_graph(run: Callable[[], Outputs], pool: tuple) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """`run` captured as a CUDA graph in memory pool `pool`, and what it returns (refilled by
    each replay). It first runs once eagerly, on the side stream the capture then uses, as
    torch.cuda.graph advises, so lazy set-up (library handles, workspaces, kernel choice) happens
    outside the capture, which refuses it. Out of memory, it gives the allocator's cache back
    and tries once more."""
    try:
        return _captured(run, pool)
    except torch.OutOfMemoryError:
        # What eager forwards freed (the start-up's first prefill, a request's activations) stays
        # cached for tensors outside any graph's pool: a pool cannot take it, so a capture can run
        # out while hundreds of MiB lie cached (about 700 MiB under a 22 GiB cap, on an H100).
        # Given back to the driver, it is the pool's to take.
        torch.cuda.empty_cache()
        return _captured(run, pool)


def _captured(run: Callable[[], Outputs], pool: tuple) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Python's garbage collector stays off while capturing (torch.cuda.graph collects just before):
    # a collection in the middle that destroys an earlier app's graphs makes CUDA calls a capture
    # refuses, and the capture fails ("operation failed due to a previous error during capture", seen
    # when the bench starts a second app). "thread_local": another thread's CUDA work, such as
    # another app's engine moving KV to host memory, does not count against this capture either.
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            output = run()
    finally:
        gc.enable()
    return graph, output


_CAPTURE_STREAMS = threading.local()


def capture_stream() -> torch.cuda.Stream:
    """This thread's stream for capturing on the current device, made once. cuBLAS keeps a workspace
    for every stream it has run on, which it never gives back: with a new stream for each capture,
    the Thinker's prefill graphs kept 38 MiB each whatever their length (1.2 GiB for 33 on an H100,
    torch 2.11). A thread's own, as two apps' engines may capture at the same time."""
    streams: dict[int, torch.cuda.Stream] = _CAPTURE_STREAMS.__dict__.setdefault("by_device", {})
    device = torch.cuda.current_device()
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def cloned(outputs: Outputs, count: int | None = None) -> Outputs:
    """Copies of a graph's outputs (of their first `count` rows, if given): the next replay
    overwrites the graph's own."""
    if isinstance(outputs, torch.Tensor):
        return outputs[:count].clone()
    return tuple(t[:count].clone() for t in outputs)
