"""Tune the triton MoE kernels' tiles on this GPU, and write them where the backend reads them.

    python -m omni_local.bench.moe_tuning                       # Thinker and Talker, all counts
    python -m omni_local.bench.moe_tuning --out DIR --seconds 170
    python -m omni_local.bench.moe_tuning --weights int4        # experts as the int4 setting holds them

For each shape (the Thinker's and the Talker's experts at full size, bfloat16 activations, the experts
in bfloat16 or quantized by --weights as model/quantized/ does) and each token count of TUNED_TOKENS
(most used first), it times the gate_up and the down kernel over a set of tiles for each BLOCK_M the
count can use, each the median of --runs CUDA-event-timed runs with the L2 cache flushed, and keeps
the BLOCK_M and tiles of the fastest pair. Tiles a GPU cannot hold (shared memory) are skipped. The
JSON goes to DIR/experts<E>_hidden<H>_intermediate<I>_<GPU>[_<weights>].json, one per shape, written
after each count, so a run stopped by --seconds leaves every count it finished (a count that is not
there takes the next one above at run time). Commit the files to omni_local/kernels/moe/tile_configs/.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.bench.moe_shapes import SHAPES, MoeShape, moe_block
from omni_local.kernels.moe.down import weighted_down
from omni_local.kernels.moe.gate_up import gate_up_silu
from omni_local.kernels.moe.routing import route
from omni_local.kernels.moe.sorting import sort_by_expert
from omni_local.kernels.moe.expert_weights import KernelWeight, kernel_weight
from omni_local.kernels.moe.tile_configs import (
    TILE_CONFIG_DIR,
    TUNED_TOKENS,
    GemmTile,
    TileConfig,
    config_file_name,
    default_config,
)
from omni_local.model.quantized import QuantizedExperts, layer_formats

# Few tiles: each is compiled once per BLOCK_M (a second or so each), which is most of the run.
TILES = [GemmTile(n, k, warps, stages) for n, k, warps, stages in (
    (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3),
    (128, 128, 8, 3),
)]


def block_sizes(tokens: int) -> list[int]:
    """BLOCK_M values worth trying: 16 for decode batches, larger where experts get more rows."""
    return [16] if tokens <= 16 else [16, 32] if tokens <= 64 else [32, 64]


def described(tile: GemmTile) -> str:
    return f"{tile.block_n}x{tile.block_k}, {tile.num_warps} warps, {tile.num_stages} stages"


def timed(call, runs: int) -> float:
    try:
        return median_cuda_ms(call, runs)
    except Exception as error:  # a tile this GPU cannot hold, refused at compile time
        if "resource" not in str(error).lower():
            raise
        return float("inf")


def expert_weights(block: torch.nn.Module, weights: str) -> tuple[KernelWeight, KernelWeight]:
    """The block's gate_up and down weights as the kernels take them, quantized as `weights` holds them."""
    experts = block.experts
    if weights == "bf16":
        return kernel_weight(experts.gate_up_proj), kernel_weight(experts.down_proj)
    quantized = QuantizedExperts.replacing(experts, layer_formats(weights)[1])
    return (kernel_weight(quantized.gate_up_values, quantized.gate_up_scales),
            kernel_weight(quantized.down_values, quantized.down_scales))


def tune_count(shape: MoeShape, gate_up: KernelWeight, down: KernelWeight, tokens: int, runs: int
               ) -> tuple[TileConfig, float, float]:
    """The fastest config for `tokens` tokens, its time and the default config's (ms, both GEMMs)."""
    hidden = torch.randn((tokens, shape.hidden), device="cuda", dtype=torch.bfloat16)
    logits = torch.randn((tokens, shape.experts), device="cuda", dtype=torch.bfloat16)
    weights, experts = route(logits, shape.top_k, True)

    def gemms_ms(block_m: int, gate_up_tile: GemmTile, down_tile: GemmTile | None) -> float:
        order = sort_by_expert(experts, shape.experts, block_m)
        first = timed(lambda: gate_up_silu(hidden, gate_up, order, experts, block_m, gate_up_tile), runs)
        if down_tile is None or first == float("inf"):
            return first
        activated = gate_up_silu(hidden, gate_up, order, experts, block_m, gate_up_tile)
        return first + timed(lambda: weighted_down(activated, down, order, experts, weights, block_m, down_tile),
                             runs)

    best, best_ms = None, float("inf")
    for block_m in block_sizes(tokens):
        gate_up_tile = min(TILES, key=lambda tile: gemms_ms(block_m, tile, None))
        order = sort_by_expert(experts, shape.experts, block_m)
        activated = gate_up_silu(hidden, gate_up, order, experts, block_m, gate_up_tile)
        down_tile = min(TILES, key=lambda tile: timed(
            lambda: weighted_down(activated, down, order, experts, weights, block_m, tile), runs))
        total = gemms_ms(block_m, gate_up_tile, down_tile)
        if total < best_ms:
            best, best_ms = TileConfig(block_m, gate_up_tile, down_tile), total
    default = default_config(tokens)
    return best, best_ms, gemms_ms(default.block_m, default.gate_up, default.down)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.moe_tuning")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["thinker", "talker"])
    parser.add_argument("--out", type=Path, default=TILE_CONFIG_DIR, help="folder for the JSON files")
    parser.add_argument("--seconds", type=float, default=600.0, help="stop starting new counts after this")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per tile")
    parser.add_argument("--weights", choices=["bf16", "fp8", "int4"], default="bf16",
                        help="the experts as this weights setting holds them")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    print(f"tuning on {device}, bfloat16 activations, {args.weights} experts; ms for gate_up + down, tuned "
          f"against the default tiles\n")
    print("| shape | tokens | BLOCK_M | gate_up tile | down tile | tuned (ms) | default (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        shape = SHAPES[name]
        block = moe_block(shape)
        gate_up, down = expert_weights(block, args.weights)
        quantized = gate_up.quantized
        path = args.out / config_file_name(shape.experts, shape.hidden, shape.intermediate, device, quantized)
        tuned: dict[int, TileConfig] = {}
        for tokens in TUNED_TOKENS:
            if time.monotonic() - started > args.seconds:
                print(f"stopped at --seconds {args.seconds:.0f}: {name} has counts {sorted(tuned)}", flush=True)
                break
            config, ms, default_ms = tune_count(shape, gate_up, down, tokens, args.runs)
            tuned[tokens] = config
            path.write_text(json.dumps({str(t): tuned[t].to_json() for t in sorted(tuned)}, indent=1) + "\n")
            print(f"| {name} | {tokens} | {config.block_m} | {described(config.gate_up)} | {described(config.down)} "
                  f"| {ms:.4f} | {default_ms:.4f} |", flush=True)
        del block, gate_up, down
        torch.cuda.empty_cache()
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
