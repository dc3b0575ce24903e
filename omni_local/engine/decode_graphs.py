"""Decode steps captured as CUDA graphs: one token of a decoder stack over a KVStore slot, the
Thinker's or the Talker's (DecodeGraphs), and steps of fixed shapes such as the code predictor's
(StepGraphs).

Eager, a decode step of transformers' modules is bound by kernel launches and host work (80 to
120 ms for the Thinker, 41 ms for the Talker at full size on an H200); replaying the same kernels
as a graph takes about 13 and 5 ms. DecodeGraphs captures one graph per attention length (bucket),
each reading only the slot's first `rows` rows, so a short chat does not attend over the whole
slot. The slot, row, position and the step's input are device tensors the graphs read when they
replay: one graph serves every slot and position. All graphs are captured at start-up, into one
memory pool per owner (its graphs never replay at the same time), so the first request pays no
capture.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from omni_local.engine.kv_store import GraphedSlotWriter, KVStore
from omni_local.model.workarounds import capturable_experts

# What a step returns: a tensor, or a tuple of them (the Talker's hidden state and logits).
Outputs = torch.Tensor | tuple[torch.Tensor, ...]
# (cache, input [1, 1] token ids or [1, 1, hidden] embeddings, positions [3, 1, 1]) -> outputs;
# the same function runs eager.
DecodeStep = Callable[[GraphedSlotWriter, torch.Tensor, torch.Tensor], Outputs]

SMALLEST_BUCKET = 256


def attention_buckets(max_tokens: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET, then `max_tokens` itself: at most twice the rows needed."""
    buckets, rows = [], SMALLEST_BUCKET
    while rows < max_tokens:
        buckets.append(rows)
        rows *= 2
    return [*buckets, max_tokens]


def graphable(stack_config: Any, device: torch.device) -> bool:
    """Whether DecodeGraphs can run the decode step of a stack with this config: on CUDA, under an
    attention that takes the bucket's mask (flash attention takes none)."""
    return device.type == "cuda" and stack_config._attn_implementation in ("sdpa", "eager")


class DecodeGraphs:
    """The one-token decode step `step`, captured for every bucket at construction and replayed from
    the smallest bucket that holds its row. `input_like` is shaped like the step's input; `slot` is
    a slot the caller holds and nobody reads (each capture's warm-up run writes its row 0);
    `stack_config` is the decoder stack's, whose MoE experts must run in a capturable way."""

    def __init__(self, step: DecodeStep, store: KVStore, input_like: torch.Tensor, slot: int,
                 stack_config: Any) -> None:
        self.store = store
        self.buckets = attention_buckets(store.shape.max_tokens)
        self._input = torch.zeros_like(input_like)  # static: copied into before each replay
        # row index, slot, position: filled by one host-to-device copy per step
        self._inputs = torch.zeros(3, dtype=torch.long, device=store.device)
        self._index, self._slot = self._inputs[0:1], self._inputs[1:2]
        # A decode step's three M-RoPE positions are equal: a text token's, or a codec frame's.
        self._positions = self._inputs[2:3].view(1, 1, 1).expand(3, 1, 1)
        self._set(index=0, slot=slot, position=0)
        pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Outputs]] = {}  # rows -> graph, its outputs
        with capturable_experts(stack_config, store.dtype):
            for rows in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
                cache = GraphedSlotWriter(store, self._slot, self._index, rows)
                self._graphs[rows] = capture_graph(partial(step, cache, self._input, self._positions), pool)

    def replay(self, slot: int, x: torch.Tensor, index: int, position: int) -> Outputs:
        """The step's outputs for input `x` at row `index` of `slot` (its keys and values written there)."""
        rows = next((b for b in self.buckets if index < b), None)
        if rows is None:
            raise IndexError(f"slot holds {self.store.shape.max_tokens} tokens, asked to write row {index}")
        self._input.copy_(x)
        self._set(index, slot, position)
        graph, outputs = self._graphs[rows]
        graph.replay()
        return cloned(outputs)

    def _set(self, index: int, slot: int, position: int) -> None:
        self._inputs.copy_(torch.tensor([index, slot, position]))


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
        return cloned(output)


def capture_graph(run: Callable[[], Outputs], pool: tuple) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """`run` captured as a CUDA graph in memory pool `pool`, and what it returns (refilled by
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


def cloned(outputs: Outputs) -> Outputs:
    """Copies of a graph's outputs: the next replay overwrites the graph's own."""
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return tuple(t.clone() for t in outputs)
