"""Where the engine's share of the GPU goes, per allocation site: the engine started as card_sizes
--plan starts it on a card of --card-gib, with torch's CUDA memory history on from just before it
starts, and one snapshot of the caching allocator once it is warm (the prefill graphs captured after
ready included).

    python -m omni_local.bench.engine_memory --random-weights CONFIG.json --weights int4 --speech true \
        --card-gib 22 --json engine-memory.json

start_up_steps.py says what each start-up step kept; this says which lines of ours allocated it.
Printed, each as a table:
- the live allocations by the innermost omni_local frame of their stack (file:line function), largest
  first, each memory pool apart: the default pool, and each CUDA graph pool (a graph's outputs, and
  what its capture left allocated, live there);
- the same per start-up step: each allocation's time in the history, placed in the step whose window
  (start_up_steps' line: its end and seconds) holds it, and the segments (cudaMalloc'd memory) each
  step reserved;
- per pool, the bytes reserved and not allocated: free blocks the pool keeps, which in a graph pool
  are the captures' intermediates (a replay writes there), elsewhere fragmentation;
- per captured graph (batch, length, rows), the bytes of the outputs it keeps.
Blocks allocated before the history began (the weights) carry no stack and are one line. --json
writes the same as JSON; the snapshot itself is never written (nothing is pickled).
"""

import json
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import omni_local
from omni_local.api import OmniLocal
from omni_local.bench.card_sizes import cap, planned
from omni_local.bench.common import bench_model, bench_parser
from omni_local.engine.forward.cuda_graphs import BatchGraphs, Outputs
from omni_local.model.loader import LoadedModel, quiet_library_logs
from omni_local.settings import Settings, settings_from_arguments
from omni_local.start_up_steps import log as start_up_log
from omni_local.start_up_steps import show_start_up_steps

PACKAGE = Path(omni_local.__file__).parent  # as code objects name their files: not resolved
MiB = 1 << 20
TOP = 30
DEFAULT_POOL = (0, 0)  # the segment_pool_id of memory outside any CUDA graph pool
BEFORE_RECORDING = "before the history began (the weights)"  # no trace entry
NO_STACK = "no Python stack: before the history began (the weights), or C++ alone"
BETWEEN_STEPS = "between start-up steps"
# A snapshot: torch.cuda.memory._snapshot()'s dict (its docstring gives the format); a block and a
# trace entry are dicts of it.
Snapshot = dict[str, Any]
Pool = tuple[int, int]


@dataclass(frozen=True)
class Step:
    """A start-up step's window on the wall clock (time.time())."""

    name: str
    began: float
    ended: float


class StepWindows(logging.Handler):
    """Each start-up step's window, from start_up_steps' line as it ends: the line's first two
    arguments are the step's name and its seconds (log_start_up_step), and the record's time is its end."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = []

    def emit(self, record: logging.LogRecord) -> None:
        name, seconds = record.args[:2]
        self.steps.append(Step(name, record.created - seconds, record.created))


@dataclass
class Total:
    bytes: int = 0
    count: int = 0

    def add(self, size: int) -> None:
        self.bytes += size
        self.count += 1


def site(frames: list[dict[str, Any]], package: Path = PACKAGE) -> str:
    """Where an allocation was made: its stack's innermost frame in `package`
    ("omni_local/engine/forward/thinker.py:123 warm_up"; frames are innermost first), else its
    innermost frame, marked outside."""
    if not frames:
        return NO_STACK
    ours = next((f for f in frames if Path(f["filename"]).is_relative_to(package)), None)
    if ours is None:
        return f"outside {package.name}: {frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}"
    return f"{Path(ours['filename']).relative_to(package.parent)}:{ours['line']} {ours['name']}"


def live_blocks(snapshot: Snapshot, device: int) -> Iterator[tuple[Pool, dict[str, Any]]]:
    """The blocks tensors hold on `device`, each with its segment's pool."""
    for segment in snapshot["segments"]:
        if segment["device"] == device:
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    yield tuple(segment["segment_pool_id"]), block


def by_site(blocks: Iterable[dict[str, Any]], package: Path = PACKAGE) -> list[tuple[str, Total]]:
    """The blocks' bytes (as the allocator holds them: rounded up) and count per site, largest first."""
    sites: dict[str, Total] = defaultdict(Total)
    for block in blocks:
        sites[site(block["frames"], package)].add(block["size"])
    return sorted(sites.items(), key=lambda item: -item[1].bytes)


def by_pool(pairs: Iterable[tuple[Pool, dict[str, Any]]]) -> dict[Pool, list[dict[str, Any]]]:
    pools: dict[Pool, list[dict[str, Any]]] = defaultdict(list)
    for pool, item in pairs:
        pools[pool].append(item)
    return dict(pools)


def unallocated(snapshot: Snapshot, device: int) -> dict[Pool, tuple[int, int]]:
    """Per pool, the bytes reserved (its segments) and of them not allocated to a tensor."""
    pools: dict[Pool, list[int]] = defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        if segment["device"] == device:
            kept = pools[tuple(segment["segment_pool_id"])]
            kept[0] += segment["total_size"]
            kept[1] += segment["total_size"] - segment["allocated_size"]
    return {pool: (reserved, free) for pool, (reserved, free) in pools.items()}


def last_times(trace: list[dict[str, Any]], action: str) -> dict[int, int]:
    """Per address, the time (time_us) of the trace's last `action` there: for a live block's
    address, its own allocation ("alloc"; none other can come after it while it lives), for a
    segment's, its cudaMalloc ("segment_alloc"). An entry without a time (a torch that records none)
    is left out: its block then counts as before the history, and wall_clock finds no markers."""
    return {entry["addr"]: entry["time_us"] for entry in trace if entry["action"] == action and "time_us" in entry}


def wall_clock(markers: list[tuple[float, int]], allocated: dict[int, int]) -> Callable[[int], float] | None:
    """time_us -> time.time(), fitted to two marker allocations (their wall time and address) made
    before and after the recorded run, so that neither the trace's clock nor its unit is assumed;
    None where the trace lost the first (it holds max_entries, the last ones)."""
    (wall_0, address_0), (wall_1, address_1) = markers
    if address_0 not in allocated or address_1 not in allocated:
        return None
    us_0, us_1 = allocated[address_0], allocated[address_1]
    scale = (wall_1 - wall_0) / (us_1 - us_0)
    return lambda us: wall_0 + (us - us_0) * scale


def step_at(when: float, steps: list[Step]) -> str:
    """The innermost (shortest) step whose window holds `when`: a step may run inside another."""
    holding = [s for s in steps if s.began <= when <= s.ended]
    return min(holding, key=lambda s: s.ended - s.began).name if holding else BETWEEN_STEPS


def steps_of(items: Iterable[tuple[int, Any]], times: dict[int, int], wall: Callable[[int], float],
             steps: list[Step]) -> dict[str, list[Any]]:
    """`items` (address, item) grouped by the step their address's time falls in."""
    grouped: dict[str, list[Any]] = defaultdict(list)
    for address, item in items:
        us = times.get(address)
        grouped[BEFORE_RECORDING if us is None else step_at(wall(us), steps)].append(item)
    return dict(grouped)


def per_step(snapshot: Snapshot, device: int, wall: Callable[[int], float], steps: list[Step]
             ) -> dict[str, dict[str, Any]]:
    """Per start-up step, what its allocations still hold by site, and the bytes of the segments it
    reserved per pool, in the steps' order (what no step holds last)."""
    trace = snapshot["device_traces"][device]
    blocks = steps_of(((b["address"], b) for _, b in live_blocks(snapshot, device)),
                      last_times(trace, "alloc"), wall, steps)
    segments = steps_of(((s["address"], s) for s in snapshot["segments"] if s["device"] == device),
                        last_times(trace, "segment_alloc"), wall, steps)
    order = [*dict.fromkeys(s.name for s in steps), BETWEEN_STEPS, BEFORE_RECORDING]
    summary = {}
    for name in order:
        if name in blocks or name in segments:
            reserved: dict[Pool, int] = defaultdict(int)
            for segment in segments.get(name, []):
                reserved[tuple(segment["segment_pool_id"])] += segment["total_size"]
            summary[name] = {"sites": by_site(blocks.get(name, [])), "reserved": dict(reserved)}
    return summary


def outputs_bytes(outputs: Outputs) -> int:
    """The bytes of a graph's outputs, each storage once (outputs may be views of one)."""
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def engine_graphs(engine: Any) -> dict[str, BatchGraphs]:
    """The engine's BatchGraphs by name (the Talker's where speech is on)."""
    runner = engine.runner
    found = {"the Thinker's decode steps": runner.decode_graphs, "the Thinker's prefills": runner.prefill_graphs}
    if engine.speaker is not None:
        found["the Talker's steps"] = engine.speaker.runner.step_graphs
    return {name: graphs for name, graphs in found.items() if graphs is not None}


def pool_names(graphs: dict[str, BatchGraphs]) -> dict[Pool, str]:
    names: dict[Pool, list[str]] = defaultdict(list)
    for name, each in graphs.items():
        names[tuple(each._pool)].append(name)  # the pool its graphs were captured in
    return {DEFAULT_POOL: "the default pool", **{pool: " and ".join(n) + f" {pool}" for pool, n in names.items()}}


def pool_name(pool: Pool, names: dict[Pool, str]) -> str:
    return names.get(pool, f"a graph pool {pool}")


def mib(count: int) -> str:
    return f"{count / MiB:,.1f}"


def site_table(sites: list[tuple[str, Total]]) -> str:
    rows = [f"| {name} | {mib(t.bytes)} | {t.count} |" for name, t in sites[:TOP]]
    left = sites[TOP:]
    if left:
        rows.append(f"| {len(left)} more sites | {mib(sum(t.bytes for _, t in left))} "
                    f"| {sum(t.count for _, t in left)} |")
    return "\n".join(["| site | MiB | blocks |", "| --- | --- | --- |", *rows])


def report(snapshot: Snapshot, device: int, wall: Callable[[int], float] | None, steps: list[Step],
           graphs: dict[str, BatchGraphs]) -> dict[str, Any]:
    """Prints the tables; returns them as JSON-ready data."""
    names = pool_names(graphs)
    return {"pools": report_pools(snapshot, device, names),
            "steps": report_steps(snapshot, device, wall, steps, names),
            "graphs": report_graphs(graphs)}


def report_pools(snapshot: Snapshot, device: int, names: dict[Pool, str]) -> dict[str, Any]:
    summary: dict[str, Any] = defaultdict(dict)
    print("## Live allocations by site, per pool\n")
    for pool, blocks in sorted(by_pool(live_blocks(snapshot, device)).items()):
        sites = by_site(blocks)
        print(f"### {pool_name(pool, names)}: {mib(sum(t.bytes for _, t in sites))} MiB allocated\n")
        print(site_table(sites) + "\n")
        summary[pool_name(pool, names)]["sites"] = _sites_json(sites)
    print("## Reserved and not allocated, per pool\n\n| pool | reserved MiB | not allocated MiB |\n| --- | --- | --- |")
    for pool, (reserved, free) in sorted(unallocated(snapshot, device).items()):
        print(f"| {pool_name(pool, names)} | {mib(reserved)} | {mib(free)} |")
        summary[pool_name(pool, names)].update(reserved=reserved, not_allocated=free)
    return dict(summary)


def report_steps(snapshot: Snapshot, device: int, wall: Callable[[int], float] | None, steps: list[Step],
                 names: dict[Pool, str]) -> dict[str, Any]:
    print("\n## Per start-up step\n")
    if wall is None:
        print("No times for the markers: the history lost its first entries (more than --max-entries: run "
              "again with more), or this torch records no times.\n")
        return {}
    summary = {}
    for name, held in per_step(snapshot, device, wall, steps).items():
        reserved = {pool_name(pool, names): size for pool, size in held["reserved"].items()}
        allocated = sum(t.bytes for _, t in held["sites"])
        print(f"### {name}: {mib(allocated)} MiB allocated; segments reserved (MiB): "
              f"{', '.join(f'{pool} {mib(size)}' for pool, size in reserved.items()) or 'none'}\n")
        print(site_table(held["sites"]) + "\n")
        summary[name] = {"sites": _sites_json(held["sites"]), "reserved": reserved}
    return summary


def report_graphs(graphs: dict[str, BatchGraphs]) -> dict[str, Any]:
    print("## Captured graphs' outputs\n")
    summary = {}
    for name, each in graphs.items():
        # BatchGraphs keeps (graph, outputs) per (batch, length, rows): the outputs live as long as it.
        outputs = sorted((key, outputs_bytes(kept)) for key, (_, kept) in each._graphs.items())
        print(f"### {name}: {len(outputs)} graphs, outputs {mib(sum(size for _, size in outputs))} MiB\n")
        print("| batch | length | rows | outputs MiB |\n| --- | --- | --- | --- |")
        print("\n".join(f"| {b} | {n} | {r} | {mib(size)} |" for (b, n, r), size in outputs) + "\n")
        summary[name] = [{"batch": b, "length": n, "rows": r, "outputs_bytes": size} for (b, n, r), size in outputs]
    return summary


def _sites_json(sites: list[tuple[str, Total]]) -> list[dict[str, Any]]:
    return [{"site": name, "bytes": t.bytes, "blocks": t.count} for name, t in sites]


def marker(device: torch.device) -> tuple[float, int, torch.Tensor]:
    """A one-element allocation now: its wall time, its address, and the tensor (kept alive until
    the snapshot, so the trace's last allocation at that address is this one)."""
    tensor = torch.empty(1, device=device)
    return time.time(), tensor.untyped_storage().data_ptr(), tensor


def recorded_start(settings: Settings, loaded: LoadedModel, max_entries: int, windows: StepWindows) -> dict[str, Any]:
    """The engine started under the memory history, the tables of the snapshot taken once it is warm."""
    # Python stacks only (C++ ones make every allocation slow), of allocations only: what a live
    # block's site and its time need.
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=max_entries)
    first = marker(loaded.device)
    with OmniLocal(settings, loaded=loaded) as app:  # returns once warm: every prefill graph captured
        last = marker(loaded.device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        device = loaded.device.index if loaded.device.index is not None else torch.cuda.current_device()
        wall = wall_clock([first[:2], last[:2]], last_times(snapshot["device_traces"][device], "alloc"))
        return report(snapshot, device, wall, windows.steps, engine_graphs(app.backend.engine))


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.engine_memory", timed=False)
    parser.add_argument("--card-gib", type=float, required=True,
                        help="the card's size: the memory plan sizes the caches for it, the process is capped there")
    parser.add_argument("--max-entries", type=int, default=3_000_000,
                        help="the memory history's length: allocations, frees and segments since the engine began")
    parser.add_argument("--json", type=Path, help="write the tables here as JSON too")
    args = parser.parse_args()
    settings = settings_from_arguments(args)
    if not torch.cuda.is_available() or settings.device == "cpu":
        sys.exit("engine_memory needs a CUDA device: torch's memory history records the CUDA caching allocator")
    quiet_library_logs()
    show_start_up_steps()
    windows = StepWindows()
    start_up_log.addHandler(windows)
    loaded = bench_model(settings, args.random_weights)
    cap(args.card_gib)
    summary = recorded_start(planned(settings, loaded, args.card_gib), loaded, args.max_entries, windows)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
