"""The Thinker's attention projections at decode sizes, each way a quantized layer can multiply:

- linear: F.linear with the weight in the rows' dtype (the bf16 model's);
- fp8 scaled_mm: each row rounded to float8, then torch._scaled_mm (the fp8 layer's path for many rows);
- fp8 gemv: our GEMV (kernels/gemv.py) over the fp8 weight;
- int8 pack_mm: torch._weight_int8pack_mm (the int8 layer's path on the CPU; on a GPU, past the GEMV, it
  dequantizes and multiplies as `linear` does);
- int8 gemv: our GEMV over the int8 weight.

Then the MoE routers' gates (bfloat16 in every format): F.linear against our GEMV, which the triton MoE
backend takes for a decode batch (engine/forward/moe/triton_backend.py).

    python -m omni_local.bench.dense_projections                    # on a GPU
    python -m omni_local.bench.dense_projections --sweep            # the GEMV's tiles, against the default
    TRITON_INTERPRET=1 python -m omni_local.bench.dense_projections --device cpu     # smoke run

On a GPU: bfloat16 rows, each call captured in a CUDA graph and replayed, the median of --runs
CUDA-event-timed replays with the L2 cache flushed before each (a decode step reads 47 other layers'
weights between two calls of one layer); the last rows add up a decode step's 96 projections (48
layers of qkv and o). Each GEMV is checked against the dequantized weight first. On the CPU: tiny
shapes in float32, eager, wall time, the GEMV in Triton's interpreter; it checks that the script
runs, its times mean nothing.
"""

import argparse
import itertools
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from omni_local.bench.common import median_wall_ms
from omni_local.bench.cuda_timing import median_cuda_ms
from omni_local.model.quantized.formats import Quantized, dequantize, quantize
from omni_local.model.quantized.linear import fp8_matmul

# Qwen3-Omni-30B-A3B's Thinker: (in, out) of each projection, q, k and v fused (engine/forward/fused_qkv.py).
THINKER = {"qkv_proj": (2048, 5120), "o_proj": (4096, 2048)}
TINY = {"qkv_proj": (64, 192), "o_proj": (128, 64)}  # the CPU smoke run's
# The routers' gates, (in, out): the Thinker's 128 experts over its hidden 2,048, the Talker's over 1,024.
ROUTERS = {"router": (2048, 128), "talker router": (1024, 128)}
TINY_ROUTERS = {"router": (64, 16)}
LAYERS = 48
ROWS = [1, 16]
WAYS = ["linear", "fp8 scaled_mm", "fp8 gemv", "int8 pack_mm", "int8 gemv"]
SWEEP = dict(block_n=(16, 32, 64), block_k=(64, 128, 256), split_k=(1, 2, 4, 8, 16), num_stages=(3, 4))


def quantized(weight: torch.Tensor, format: str) -> Quantized:
    """`weight` as a QuantizedLinear holds it: int8's scales in the model's dtype."""
    stored = quantize(weight, format)
    return stored if format == "fp8" else Quantized(format, stored.values, stored.scales.to(weight.dtype))


def calls(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each way's call for rows `x` through `weight` [N, K] (the GEMV's checked on the way)."""
    from omni_local.kernels.gemv import quantized_gemv  # imports triton

    fp8, int8 = quantized(weight, "fp8"), quantized(weight, "int8")
    for stored in (fp8, int8):
        reference = x.float() @ dequantize(stored, torch.float32).T
        error = (quantized_gemv(x, stored.values, stored.scales).float() - reference).norm() / reference.norm()
        if error > 0.01:
            raise AssertionError(f"the {stored.format} GEMV is off by {error:.2%} of the output's norm")
    return {
        "linear": lambda: F.linear(x, weight),
        "fp8 scaled_mm": lambda: fp8_matmul(x, fp8.values, fp8.scales),
        "fp8 gemv": lambda: quantized_gemv(x, fp8.values, fp8.scales),
        "int8 pack_mm": lambda: torch._weight_int8pack_mm(x, int8.values, int8.scales),
        "int8 gemv": lambda: quantized_gemv(x, int8.values, int8.scales),
    }


def median_us(call: Callable[[], object], device: str, runs: int) -> float:
    """On a GPU, a CUDA graph of `call` replayed; elsewhere `call` itself, wall time."""
    if device != "cuda":
        return median_wall_ms(call, runs) * 1e3
    from omni_local.engine.forward.cuda_graphs import capture_graph

    graph, _ = capture_graph(call, torch.cuda.graph_pool_handle())
    return median_cuda_ms(graph.replay, runs) * 1e3


def inputs(shape: tuple[int, int], rows: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    in_features, out_features = shape
    weight = torch.randn((out_features, in_features), device=device, dtype=dtype) / in_features ** 0.5
    return torch.randn((rows, in_features), device=device, dtype=dtype), weight


def print_table(shapes: dict[str, tuple[int, int]], row_counts: list[int], dtype: torch.dtype, device: str,
                runs: int) -> None:
    print(f"| projection | rows | {' | '.join(f'{way} (µs)' for way in WAYS)} |")
    print("| --- | --- |" + " --- |" * len(WAYS))
    steps = {rows: [0.0] * len(WAYS) for rows in row_counts}
    for rows in row_counts:
        for name, shape in shapes.items():
            times = [median_us(call, device, runs) for call in calls(*inputs(shape, rows, dtype, device)).values()]
            steps[rows] = [total + t * LAYERS / 1e3 for total, t in zip(steps[rows], times)]
            print(f"| {name} {shape[0]}->{shape[1]} | {rows} | {' | '.join(f'{t:.2f}' for t in times)} |", flush=True)
    print(f"\nA decode step's {len(shapes) * LAYERS} projections ({LAYERS} layers of {', '.join(shapes)}), ms:\n")
    print(f"| rows | {' | '.join(WAYS)} |")
    print("| --- |" + " --- |" * len(WAYS))
    for rows, totals in steps.items():
        print(f"| {rows} | {' | '.join(f'{t:.3f}' for t in totals)} |")


def print_router_table(shapes: dict[str, tuple[int, int]], row_counts: list[int], dtype: torch.dtype, device: str,
                       runs: int) -> None:
    from omni_local.kernels.gemv import invariant_matmul  # imports triton

    print("\n| router | rows | linear (µs) | gemv (µs) |")
    print("| --- | --- | --- | --- |")
    for rows in row_counts:
        for name, shape in shapes.items():
            x, weight = inputs(shape, rows, dtype, device)
            torch.testing.assert_close(invariant_matmul(x, weight), F.linear(x, weight), rtol=2e-2, atol=2e-2)
            times = [median_us(lambda: F.linear(x, weight), device, runs),
                     median_us(lambda: invariant_matmul(x, weight), device, runs)]
            print(f"| {name} {shape[0]}->{shape[1]} | {rows} | {' | '.join(f'{t:.2f}' for t in times)} |", flush=True)


def print_sweep(shapes: dict[str, tuple[int, int]], row_counts: list[int], dtype: torch.dtype, runs: int) -> None:
    """Each shape's GEMV tiles timed at every row count, both formats; the best by the sum of them all
    (one tile a shape: the reduction order may not change with the rows), against the default."""
    from omni_local.kernels.gemv import gemv
    from omni_local.kernels.gemv_tiles import DEFAULT

    device_name = torch.cuda.get_device_name()
    print("| projection | default (µs) | best (µs) | block_n | block_k | split_k | stages | best per case (µs) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape in shapes.items():
        cases = []  # (rows, values, scales)
        for rows in row_counts:
            x, weight = inputs(shape, rows, dtype, "cuda")
            if name in ROUTERS:
                cases.append((x, weight, None))
            else:
                cases += [(x, w.values, w.scales) for w in (quantized(weight, format) for format in ("fp8", "int8"))]

        def total_us(tile) -> tuple[float, list[float]]:
            times = [timed(lambda case=case: gemv(*case, tile), runs) for case in cases]
            return sum(times), times

        tiles = [replace(DEFAULT, **dict(zip(SWEEP, values))) for values in itertools.product(*SWEEP.values())]
        tiles = [t for t in tiles if -(-shape[0] // t.block_k) >= t.split_k]  # no split without a K step
        default_us, _ = total_us(DEFAULT)
        best = min(((total_us(tile), tile) for tile in tiles), key=lambda pair: pair[0][0])
        (best_us, per_case), tile = best
        print(f"| {name} {shape[0]}->{shape[1]} | {default_us:.2f} | {best_us:.2f} | {tile.block_n} | {tile.block_k} "
              f"| {tile.split_k} | {tile.num_stages} | {', '.join(f'{t:.2f}' for t in per_case)} |", flush=True)
        print(f"    TUNED[({device_name!r}, {shape[1]}, {shape[0]})] = {tile}", flush=True)
    print(f"\n(sums over rows {row_counts} x fp8, int8, a router's over rows in bf16; the cases in that order)")


def timed(call: Callable[[], object], runs: int) -> float:
    """Median µs of `call` graphed; infinite for a tile this GPU cannot hold (refused at compile time)."""
    try:
        return median_us(call, "cuda", runs)
    except Exception as error:
        if "resource" not in str(error).lower():
            raise
        return float("inf")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.dense_projections")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="rows a call (the decode batch)")
    parser.add_argument("--runs", type=int, default=200, help="timed calls per cell")
    parser.add_argument("--sweep", action="store_true", help="time the GEMV's tiles instead (GPU only)")
    parser.add_argument("--shapes", nargs="+", help="these projections and routers only (by name)")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on the CPU the GEMV runs in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.sweep and not on_gpu:
        parser.error("--sweep times tiles on a GPU")
    shapes, routers, dtype = (THINKER, ROUTERS, torch.bfloat16) if on_gpu else (TINY, TINY_ROUTERS, torch.float32)
    if args.shapes:
        shapes, routers = ({name: shape for name, shape in named.items() if name in args.shapes}
                           for named in (shapes, routers))
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (smoke run: the times mean nothing)"
    print(f"the Thinker's attention projections, {dtype}, {device_name}; median µs of {args.runs}"
          f"{', CUDA graphs, L2 flushed' if on_gpu else ''}\n")
    if args.sweep:
        print_sweep(shapes | routers, args.rows, dtype, args.runs)
    else:
        print_table(shapes, args.rows, dtype, args.device, args.runs)
        print_router_table(routers, args.rows, dtype, args.device, args.runs)


if __name__ == "__main__":
    main()
