"""One MoE layer at full size on the GPU, per backend: router, routed experts and (the Talker's)
shared expert, as a decoder layer runs them (`mlp_output`), in bfloat16.

    python -m omni_local.bench.moe_layer                          # the Thinker's layer
    python -m omni_local.bench.moe_layer --shape talker --runs 500

Each cell is the median of --runs CUDA-event-timed calls with the L2 cache flushed before each:
eager (the launches included) and replayed as a CUDA graph (as the engine's decode steps and
prefills run it; the compiled layers would fuse the router's softmax and the top-k sum further).
"""

import argparse

import torch

from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.bench.moe_shapes import SHAPES, moe_block
from omni_local.engine.cuda_graphs import capture_graph
from omni_local.engine.moe import TORCH, MoeBackend, mlp_output, moe_backend

TOKENS = [1, 16, 128, 512]


def layer_ms(block: torch.nn.Module, backend: MoeBackend, tokens: int, runs: int) -> tuple[float, float]:
    """(eager, graphed) median ms of one layer's MoE for `tokens` tokens."""
    hidden = torch.randn((1, tokens, block.gate.weight.shape[1]), device="cuda", dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        return mlp_output(block, hidden, backend)

    eager = median_cuda_ms(call, runs)
    with backend.capturable(block.experts.config, torch.bfloat16):
        graph, _ = capture_graph(call, torch.cuda.graph_pool_handle())
    return eager, median_cuda_ms(graph.replay, runs)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.moe_layer")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="thinker")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--runs", type=int, default=200, help="timed calls per cell")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
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
