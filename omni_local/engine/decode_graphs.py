"""Decode steps captured as CUDA graphs: the Thinker's over the engine's KVStore (DecodeGraphs),
and steps of fixed shapes such as the code predictor's (StepGraphs).

Eager, a decode step of transformers' modules is bound by kernel launches and host work (80 to
120 ms at full size on an H200); replaying the same kernels as a graph takes about 13 ms.
DecodeGraphs captures one graph per attention length (bucket), each reading only the slot's first
`rows` rows, so a short chat does not attend over the whole slot. The slot, row, token and
position are device tensors the graphs read when they replay: one graph serves every slot and
position. All graphs are captured at start-up, into one memory pool per owner (its graphs never
replay at the same time), so the first request pays no capture.
"""

from collections.abc import Callable
from functools import partial

import torch

from omni_local.engine.kv_store import GraphedSlotWriter, KVStore

# (cache, token ids [1, 1], positions [3, 1, 1]) -> logits [vocab]; the same function runs eager.
DecodeStep = Callable[[GraphedSlotWriter, torch.Tensor, torch.Tensor], torch.Tensor]

SMALLEST_BUCKET = 256


def attention_buckets(max_tokens: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET, then `max_tokens` itself: at most twice the rows needed."""
    buckets, rows = [], SMALLEST_BUCKET
    while rows < max_tokens:
        buckets.append(rows)
        rows *= 2
    return [*buckets, max_tokens]


class DecodeGraphs:
    """The one-token decode step `step`, replayed from the smallest bucket that holds its row."""

    def __init__(self, step: DecodeStep, store: KVStore) -> None:
        self.step, self.store = step, store
        self.buckets = attention_buckets(store.shape.max_tokens)
        # token, row index, slot, position: filled by one host-to-device copy per step
        self._inputs = torch.zeros(4, dtype=torch.long, device=store.device)
        self._ids = self._inputs[0:1].view(1, 1)
        self._index, self._slot = self._inputs[1:2], self._inputs[2:3]
        # A text token's three M-RoPE positions are equal.
        self._positions = self._inputs[3:4].view(1, 1, 1).expand(3, 1, 1)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # rows -> graph, its logits

    def capture(self, slot: int) -> None:
        """Capture every bucket's graph; the warm-up run of each writes row 0 of `slot`, a slot the
        caller holds and nobody reads."""
        self._set(token=0, index=0, slot=slot, position=0)
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
            cache = GraphedSlotWriter(self.store, self._slot, self._index, rows)
            self._graphs[rows] = capture_graph(partial(self.step, cache, self._ids, self._positions), pool)

    def replay(self, slot: int, token: int, index: int, position: int) -> torch.Tensor:
        """The logits [vocab] of `token` at row `index` of `slot` (its keys and values written there)."""
        rows = next((b for b in self.buckets if index < b), None)
        if rows is None:
            raise IndexError(f"slot holds {self.store.shape.max_tokens} tokens, asked to write row {index}")
        self._set(token, index, slot, position)
        graph, logits = self._graphs[rows]
        graph.replay()
        # A copy: the next replay overwrites the graph's own output.
        return logits.clone()

    def _set(self, token: int, index: int, slot: int, position: int) -> None:
        self._inputs.copy_(torch.tensor([token, index, slot, position]))


class StepGraphs:
    """Steps of fixed shapes, one graph each: the code predictor's steps, the n-th of a frame always
    at the same rows. Step `i` is `step(i, x)` with `x` shaped like `inputs[i]`."""

    def __init__(self, step: Callable[[int, torch.Tensor], torch.Tensor], inputs: list[torch.Tensor]) -> None:
        self._inputs = inputs  # static buffers, copied into before each replay
        pool = torch.cuda.graph_pool_handle()
        self._graphs = [capture_graph(partial(step, i, x), pool) for i, x in enumerate(inputs)]

    def replay(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._inputs[i].copy_(x)
        graph, output = self._graphs[i]
        graph.replay()
        return output.clone()  # the next replay overwrites the graph's own output


def capture_graph(run: Callable[[], torch.Tensor], pool: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` captured as a CUDA graph in memory pool `pool`, and the tensor it returns (refilled by
    each replay). It first runs once eagerly, on a side stream as torch.cuda.graph advises, so lazy
    set-up (library handles, workspaces, kernel choice) happens outside the capture, which refuses it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output
