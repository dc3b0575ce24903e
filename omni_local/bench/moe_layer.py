"""One MoE layer at full size on the GPU, per backend: router, routed experts and (the Talker's)
shared expert, as a decoder layer runs them (`mlp_output`), in bfloat16.

    python -m omni_local.bench.moe_layer                          # the Thinker's layer
    python -m omni_local.bench.moe_layer --shape talker --runs 500
    python -m omni_local.bench.moe_layer --sort                   # the two sorts alone, in µs

Each cell is the median of --runs CUDA-event-timed calls with the L2 cache flushed before each:
eager (the launches included) and replayed as a CUDA graph (as the engine's decode steps and
prefills run it; the compiled layers would fuse the router's softmax and the top-k sum further).
--sort times the sort by expert alone instead, both ways (one program, and in chunks), at the
BLOCK_M the layer takes for the count, and checks that they give the same rows.
"""

import argparse

import torch

from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.bench.moe_shapes import SHAPES, MoeShape, moe_block
from omni_local.engine.forward.cuda_graphs import capture_graph
from omni_local.engine.forward.moe import TORCH, MoeBackend, mlp_output, moe_backend
from omni_local.kernels.moe.routing import route
from omni_local.kernels.moe.sorting import CHUNK_PAIRS, sort_in_chunks, sort_in_one_program
from omni_local.kernels.moe.tile_configs import tile_config

TOKENS = [1, 16, 128, 512, 2048]  # 2,048: a prefill chunk


def layer_ms(block: torch.nn.Module, backend: MoeBackend, tokens: int, runs: int) -> tuple[float, float]:
    """(eager, graphed) median ms of one layer's MoE for `tokens` tokens."""
    hidden = torch.randn((1, tokens, block.gate.weight.shape[1]), device="cuda", dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        return mlp_output(block, hidden, backend)

    eager = median_cuda_ms(call, runs)
    with backend.capturable(block.experts.config, torch.bfloat16):
        graph, _ = capture_graph(call, torch.cuda.graph_pool_handle())
    return eager, median_cuda_ms(graph.replay, runs)


def sort_us(shape: MoeShape, tokens: int, runs: int) -> tuple[float, float, float, float]:
    """(eager, graphed) median µs of the one-program sort, then of the sort in chunks, for `tokens`
    tokens routed by random logits."""
    logits = torch.randn((tokens, shape.experts), device="cuda", dtype=torch.bfloat16)
    _, experts = route(logits, shape.top_k, True)
    block_m = tile_config(shape.experts, shape.hidden, shape.intermediate, tokens, logits.device).block_m
    sorts = (lambda: sort_in_one_program(experts, shape.experts, block_m),
             lambda: sort_in_chunks(experts, shape.experts, block_m, CHUNK_PAIRS))
    if not torch.equal(sorts[0](), sorts[1]()):
        raise AssertionError(f"the two sorts of {tokens} tokens differ")
    times = []
    for call in sorts:
        graph, _ = capture_graph(call, torch.cuda.graph_pool_handle())
        times += [1000 * median_cuda_ms(call, runs), 1000 * median_cuda_ms(graph.replay, runs)]
    return tuple(times)


def print_sorts(name: str, shape: MoeShape, token_counts: list[int], runs: int) -> None:
    print(f"{name} sort by expert ({shape.experts} experts, top-{shape.top_k}), {torch.cuda.get_device_name()}; "
          f"median µs of {runs}, chunks of {CHUNK_PAIRS} pairs\n")
    print("| tokens | pairs | one program eager | one program graphed | chunks eager | chunks graphed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in token_counts:
        cells = " | ".join(f"{us:.1f}" for us in sort_us(shape, tokens, runs))
        print(f"| {tokens} | {tokens * shape.top_k} | {cells} |", flush=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.moe_layer")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="thinker")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--runs", type=int, default=200, help="timed calls per cell")
    parser.add_argument("--sort", action="store_true", help="time the sort by expert alone, both ways")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.sort:
        print_sorts(args.shape, shape, args.tokens, args.runs)
        return
    block = moe_block(shape)
    backends = [TORCH, moe_backend("triton", torch.device("cuda"))]
    print(f"{args.shape} MoE layer ({shape.experts} experts, top-{shape.top_k}, hidden {shape.hidden}, "
          f"intermediate {shape.intermediate}), bfloat16, {torch.cuda.get_device_name()}; "
          f"median ms of {args.runs}\n")
    header = " | ".join(f"{b.name} eager | {b.name} graphed" for b in backends)
    print(f"| tokens | {header} | graphed speed-up |")
    print("| --- |" + " --- |" * (2 * len(backends) + 1))
    for tokens in args.tokens:
        times = [layer_ms(block, backend, tokens, args.runs) for backend in backends]
        cells = " | ".join(f"{eager:.4f} | {replayed:.4f}" for eager, replayed in times)
        print(f"| {tokens} | {cells} | {times[0][1] / times[1][1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
