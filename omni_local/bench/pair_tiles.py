"""Time the pair kernels (kernels/moe/pairs.py: a decode step's quantized experts at up to 4
tokens) over their tiles on this GPU, and print a table per format, kernel and shape, fastest first.

    python -m omni_local.bench.pair_tiles                 # int4 and fp8, Thinker and Talker, 1 token
    python -m omni_local.bench.pair_tiles --weights fp8 --tokens 1 4 --runs 50

Each cell is the median of --runs CUDA-event-timed calls with the L2 cache flushed (a decode step
reads 48 layers' experts between two calls of one layer), for the full-size experts quantized as the
weights setting holds them. The fastest tile over the token counts (summed) is the one to put in
pairs.py's GATE_UP_TILES and DOWN_TILES; the GB/s column is the weight bytes the pairs read.
"""

import argparse
import itertools

import torch

from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.bench.moe_shapes import SHAPES, moe_block
from omni_local.bench.moe_tuning import expert_weights
from omni_local.kernels.moe.expert_weights import KernelWeight
from omni_local.kernels.moe.pairs import (DOWN_TILES, GATE_UP_TILES, PairTile, gate_up_silu_by_pair,
                                          weighted_down_by_pair)
from omni_local.kernels.moe.routing import route

# Each tile compiles once per kernel (about a second): 60 tiles, a minute or two a kernel and shape.
TILES = [PairTile(n, inputs, warps)
         for n, inputs, warps in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024, 2048), (2, 4, 8))]


def pair_bytes(weight: KernelWeight, pairs: int) -> int:
    """The weight bytes (values and scales) `pairs` distinct experts' rows of `weight` take."""
    per_expert = weight.values[0].numel() * weight.values.element_size()
    per_expert += weight.scales[0].numel() * weight.scales.element_size()
    return pairs * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.pair_tiles")
    parser.add_argument("--weights", nargs="+", choices=sorted(GATE_UP_TILES), default=sorted(GATE_UP_TILES))
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["thinker", "talker"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--top", type=int, default=8, help="rows per table")
    args = parser.parse_args()
    print(f"Pair kernels on {torch.cuda.get_device_name()}, bfloat16 activations; µs summed over "
          f"{args.tokens} tokens (each: its own routing, distinct experts)")
    for weights, name in itertools.product(args.weights, args.shapes):
        shape = SHAPES[name]
        gate_up, down = expert_weights(moe_block(shape), weights)
        cases = []
        for tokens in args.tokens:
            hidden = torch.randn((tokens, shape.hidden), device="cuda", dtype=torch.bfloat16)
            logits = torch.randn((tokens, shape.experts), device="cuda", dtype=torch.bfloat16)
            routing, experts = route(logits, shape.top_k, True)
            activated = gate_up_silu_by_pair(hidden, gate_up, experts)
            cases.append((hidden, routing, experts, activated))
        kernels = {  # each: the tile it has now, its weight, and a call of it on a case with a tile
            "gate_up": (GATE_UP_TILES[weights], gate_up,
                        lambda tile, case: gate_up_silu_by_pair(case[0], gate_up, case[2], tile)),
            "down": (DOWN_TILES[weights], down,
                     lambda tile, case: weighted_down_by_pair(case[3], down, case[2], case[1], tile)),
        }
        for kernel, (current, weight, call) in kernels.items():
            timed = {tile: sum(median_cuda_ms(lambda: call(tile, case), args.runs) for case in cases) * 1e3
                     for tile in dict.fromkeys([current, *TILES])}
            read = sum(pair_bytes(weight, case[2].numel()) for case in cases)
            print(f"\n{weights} {name} {kernel} (now {current}: {timed[current]:.1f} µs)\n")
            print("| BLOCK_N | inputs a step | warps | µs | GB/s |\n| --- | --- | --- | --- | --- |")
            for tile in sorted(timed, key=timed.get)[: args.top]:
                print(f"| {tile.block_n} | {tile.most_inputs_a_step} | {tile.num_warps} | {timed[tile]:.1f} "
                      f"| {read / timed[tile] / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
