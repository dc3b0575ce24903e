"""Where the Thinker's decode step's time goes: kernel time per step by category, under torch.profiler.

    python -m omni_local.bench.profile_decode                                # demo model, CPU smoke run
    python -m omni_local.bench.profile_decode --random-weights CONFIG.json   # full size: 1 chat, 256 rows
    python -m omni_local.bench.profile_decode --random-weights CONFIG.json --moe-backend torch --chats 16

The step is one of bench.decode_steps' (`--chats` distinct chats decoding together, each its own
token at its own row, spread around `--context`), profiled one of two ways (`--step`):
- `replay`, the default where the runner captured its decode graphs: the graph's replay, as the
  engine runs it. CUPTI records each kernel a graph launches, by name, though no CPU op launches it;
  where it records none, the script says so and profiles `eager` instead.
- `eager`: the forward the graph captured, launched kernel by kernel: the graph's own cache writer
  over the same bucket of rows, the compiled layers, the backend's capturable experts. The first profile
  (docs/benchmarks/2026-11-30-compiled-layers.md) was made so. The same forward, so the replay's
  kernels, less its copies of the inputs and outputs.
On the CPU there are no kernels: each ATen op counts, with its self time, and the step is eager.

Each of --runs steps is profiled alone, after a warm-up step and a warm-up profile; a category's
cells are medians over the steps, the total row their sum. The wall times are of the same steps
unprofiled, median of --runs.
"""

import re
import statistics
from collections import Counter
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_parser, median_wall_ms, settings_and_model
from omni_local.bench.decode_steps import (chat_contexts, chat_tokens, decode_step, device_label, fits,
                                          held_tables, within_context)
from omni_local.engine.forward.cuda_graphs import attention_buckets
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.engine.memory.kv_store import BlockTable, GraphedKVWriter

EXPERTS, ROUTING, DENSE, ATTENTION = "MoE experts GEMMs", "MoE routing", "dense GEMM/GEMV", "attention"
KV, ELEMENTWISE, OTHER = "KV cache write and copies", "norms, rotary, softmax, elementwise", "other"
CATEGORIES = [EXPERTS, ROUTING, DENSE, ATTENTION, KV, ELEMENTWISE, OTHER]

# (pattern, category): a kernel (on the CPU, an ATen op) counts in the first category whose pattern
# its name holds, case aside; OTHER where none does. A name does not say who launched it: aten's
# index kernels serve the cache write, the copy of the bucket's rows and the torch backend's gather of
# the tokens by expert alike (all KV); on the GPU, the torch backend's experts outside bfloat16, which
# a graph runs as batched GEMMs (`capturable_experts`), are cuBLAS kernels named as the dense ones.
PATTERNS = [
    # the triton backend's (kernels/moe/): the sorted blocks', and quantized experts' by pair
    (r"_gate_up_kernel|_down_kernel|_pairs_kernel", EXPERTS),
    # the triton backend on the CPU, in Triton's interpreter: one op, its routing and sort included
    (r"omni_local::routed_experts", EXPERTS),
    # the torch backend's torch._grouped_mm: CUTLASS kernels of a GroupProblemShape (Hopper) or
    # GemmGrouped; aten::_grouped_mm on the CPU
    (r"group", EXPERTS),
    # the torch backend's batched_mm experts (outside bfloat16) on the CPU, where nothing else in a
    # decode step runs bmm; cuBLAS's batched kernels on the GPU are named as its dense ones
    (r"aten::bmm$", EXPERTS),
    # the graph's cache writer: index_put_ of the new rows, the gather (aten::index) of the bucket's
    # blocks; before the "sort" of routing, which index_put_with_sort_kernel holds
    (r"index_put|index_?select|aten::index$", KV),
    # the triton backend's kernels; the torch backend's ATen kernels, which inductor leaves alone
    (r"_route_kernel|_sort_kernel|topk|sort|histc|histogram|cumsum|scan", ROUTING),
    (r"triton_(poi|red|per)_", ELEMENTWISE),  # inductor's fusions in the compiled layers; names like _to_copy_mul_
    (r"memcpy|memset|copy|index", KV),  # copies; aten::index's gathers
    (r"attention|attn|sdpa|flash|fmha", ATTENTION),  # cuDNN's, flash and memory-efficient SDPA (before cutlass)
    # the attention projections, the router and lm_head: cuBLAS (nvjet, gemv, xmma) or CUTLASS; our
    # GEMV (_gemv_kernel) for quantized projections and a decode batch's routers
    (r"gemm|gemv|nvjet|splitkreduce|cublas|cutlass|xmma|aten::(addmm|mm|matmul|linear)$", DENSE),
    (r"elementwise|reduce_kernel|softmax|norm|rotary"
     r"|aten::(add|sub|mul|div|neg|pow|rsqrt|mean|sum|silu|sigmoid|exp|cos|sin|where|masked_fill|cat)_?$", ELEMENTWISE),
]
_COMPILED = [(re.compile(pattern, re.IGNORECASE), category) for pattern, category in PATTERNS]
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of GPU work

Work = list[tuple[str, float]]  # (kernel or op name, µs) of one step


def category(name: str) -> str:
    return next((c for pattern, c in _COMPILED if pattern.search(name)), OTHER)


def step_work(step: Callable[[], object], cuda: bool) -> Work:
    """Each kernel, copy and memset that one `step` ran on the GPU, with its time; on the CPU, each
    ATen op with its self time (its children's apart)."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if is_work(e, DeviceType.CUDA, DEVICE_WORK)]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if is_work(e, DeviceType.CPU, ("cpu_op",))]


def is_work(event: object, device: DeviceType, activities: tuple[str, ...]) -> bool:
    """Whether a profiler event is work on `device` (not a range of record_function's, nor the
    profiler's own overhead). torch 2.13 on tells its activity; before, where it ran and whether it
    is a range is all an event says."""
    activity = getattr(event, "activity_type", None)
    if activity is not None:
        return activity in activities
    return event.device_type == device and not event.is_user_annotation


def profiled_steps(step: Callable[[], object], runs: int, cuda: bool) -> list[Work]:
    step()  # first use: compiles, library heuristics
    step_work(step, cuda)  # the profiler's own first start
    return [step_work(step, cuda) for _ in range(runs)]


def category_rows(steps: list[Work]) -> list[tuple[str, float, float]]:
    """(category, kernels, ms) per step, each the median over `steps`, in CATEGORIES' order."""
    counts = [Counter(category(name) for name, _ in work) for work in steps]
    times = [Counter() for _ in steps]
    for work, spent in zip(steps, times):
        for name, us in work:
            spent[category(name)] += us / 1e3
    return [(c, statistics.median(n[c] for n in counts), statistics.median(t[c] for t in times)) for c in CATEGORIES]


def eager_step(runner: ThinkerRunner, tables: list[BlockTable], contexts: list[int]) -> Callable[[], object]:
    """decode_step's step as the decode graph captured it, run eagerly: `_decode_step` over a
    GraphedKVWriter (its index_put_ and its gather of the bucket of rows holding the longest context),
    in the MoE backend's capturable context."""
    device, batch, size = runner.device, len(tables), runner.kv.shape.block_tokens
    indices = torch.tensor([c - 1 for c in contexts], device=device)[:, None]
    rows = next(r for r in attention_buckets(runner.kv.shape.max_tokens) if max(contexts) <= r)
    width = runner.kv.shape.blocks_for(rows)
    padded = torch.zeros((batch, width), dtype=torch.long)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = torch.tensor(table)
    on_device = padded.to(device)
    cache = GraphedKVWriter(runner.kv, on_device, indices, on_device.gather(1, indices // size),
                            indices % size, torch.zeros(batch, dtype=torch.long, device=device), rows)
    vocab = runner.model.get_input_embeddings().num_embeddings
    ids = torch.tensor(chat_tokens(batch, vocab), device=device)[:, None]
    positions = indices.view(1, batch, 1).expand(3, -1, -1)

    def step() -> torch.Tensor:
        with torch.inference_mode(), runner.regions.moe.capturable(runner.text.config, runner.dtype):
            return runner._decode_step(cache, ids, positions)

    return step


def print_table(rows: list[tuple[str, float, float]]) -> None:
    total_kernels, total_ms = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print("| category | kernels per step | ms per step | share |")
    print("| --- | --- | --- | --- |")
    for name, kernels, ms in rows:
        print(f"| {name} | {kernels:g} | {ms:.3f} | {ms / total_ms:.1%} |")
    print(f"| total | {total_kernels:g} | {total_ms:.3f} | 100.0% |")


def print_top(profiled: list[Work], count: int) -> None:
    """The `count` kernels (or ops) of most time per step, mean over the steps, with their category."""
    per_step = Counter()
    for work in profiled:
        for name, us in work:
            per_step[name] += us / len(profiled)
    print("\n| kernel | category | µs per step |\n| --- | --- | --- |")
    for name, us in per_step.most_common(count):
        print(f"| {name[:90]} | {category(name)} | {us:.1f} |")


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.profile_decode")
    parser.add_argument("--chats", type=int, default=1, help="chats decoding together")
    parser.add_argument("--context", type=int, default=256, help="rows of context")
    parser.add_argument("--top", type=int, default=0, help="also list this many kernels taking the most time")
    parser.add_argument("--step", choices=["replay", "eager"],
                        help="profile the decode graph's replay, or its forward run eagerly (default: replay where "
                             "there are graphs)")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    with OmniLocal(settings, loaded=loaded) as app:
        runner = app.backend.engine.runner
        if not within_context(runner, args.context) or not fits(runner, args.chats, args.context):
            parser.error(f"{args.chats} chats of {args.context} rows: the KV store has {runner.kv.pool.free} free "
                         f"blocks of {runner.kv.shape.block_tokens} rows, a decode step {runner.max_batch} chats at "
                         "most (--gpu-cache-bytes, --max-running-requests)")
        if args.step == "replay" and runner.decode_graphs is None:
            parser.error("--step replay: the runner captured no decode graphs (on the CPU, or with cuda_graphs off)")
        cuda = runner.device.type == "cuda"
        contexts = chat_contexts(args.chats, args.context)
        with held_tables(runner.kv, contexts) as tables:
            steps = {"eager": eager_step(runner, tables, contexts)}
            if runner.decode_graphs is not None:
                steps["replay"] = decode_step(runner, tables, contexts)
            way = args.step or ("replay" if "replay" in steps else "eager")
            profiled = profiled_steps(steps[way], args.runs, cuda)
            # The replay's own input copies are all there is where CUPTI saw none of the graph's kernels.
            if way == "replay" and all(category(name) == KV for work in profiled for name, _ in work):
                print("The profiler recorded no kernel of the graph's replay: profiling the eager step instead.\n")
                way, profiled = "eager", profiled_steps(steps["eager"], args.runs, cuda)
            if not any(profiled):
                raise SystemExit("The profiler recorded no kernel at all: on a GPU, torch's profiler needs CUPTI")
            walls = {name: median_wall_ms(step, args.runs) for name, step in steps.items()}
        what = "kernels" if cuda else "ATen ops, self CPU time"
        print(f"Thinker decode step by kernel category ({way}, MoE backend {runner.regions.moe.name}), "
              f"{args.chats} distinct chats at about {args.context} rows of context; {what}, per step, medians of {args.runs} "
              f"steps; {device_label(runner)}\n")
        print_table(category_rows(profiled))
        if args.top:
            print_top(profiled, args.top)
        print(f"\nWall time per step, unprofiled, median of {args.runs}: "
              + "; ".join(f"{name} {ms:.2f} ms" for name, ms in walls.items()))


if __name__ == "__main__":
    main()
