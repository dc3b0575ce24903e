"""bench/engine_memory.py's sums over a hand-made snapshot (torch.cuda.memory._snapshot()'s format),
and its refusal without CUDA."""

import logging
import sys

import pytest
import torch

from omni_local.bench import engine_memory
from omni_local.bench.engine_memory import (BEFORE_RECORDING, BETWEEN_STEPS, NO_STACK, PACKAGE, Step, StepWindows,
                                            Total, by_site, live_blocks, outputs_bytes, per_step, site, step_at,
                                            unallocated, wall_clock)
from omni_local.start_up_steps import log as start_up_log
from omni_local.start_up_steps import log_start_up_step

GRAPH_POOL = (0, 7)


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


TORCH_FRAME = frame("/venv/site-packages/torch/nn/functional.py", 99, "linear")
WARM_UP = [TORCH_FRAME, frame(f"{PACKAGE}/engine/forward/thinker.py", 112, "warm_up"), frame("/x/run.py", 1, "main")]
KV = [frame(f"{PACKAGE}/engine/memory/kv_store.py", 40, "for_budget")]
CAPTURE = [TORCH_FRAME, frame(f"{PACKAGE}/engine/forward/cuda_graphs.py", 250, "capture_graph")]


def block(address: int, size: int, frames: list, state: str = "active_allocated") -> dict:
    return {"address": address, "size": size, "requested_size": size, "state": state, "frames": frames}


def segment(address: int, pool: tuple, blocks: list, device: int = 0) -> dict:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": address, "segment_pool_id": pool, "blocks": blocks,
            "total_size": sum(b["size"] for b in blocks), "allocated_size": allocated}


def entry(action: str, address: int, time_us: int) -> dict:
    return {"action": action, "addr": address, "time_us": time_us, "size": 0, "stream": 0}


SNAPSHOT = {
    "segments": [
        segment(0, (0, 0), [block(0, 512, []), block(512, 512, [], "inactive")]),  # the weights', before recording
        segment(1000, (0, 0), [block(1000, 1024, WARM_UP), block(2024, 2048, KV), block(4072, 1024, [], "inactive")]),
        segment(10_000, GRAPH_POOL, [block(10_000, 2048, CAPTURE), block(12_048, 6144, CAPTURE, "inactive")]),
        segment(20_000, (0, 0), [block(20_000, 4096, KV)], device=1),  # another card's
    ],
    "device_traces": [[
        entry("segment_alloc", 1000, 1_000),
        entry("alloc", 2024, 1_100),  # the KV, between steps
        entry("alloc", 1000, 2_450),  # an earlier block there, in another step, freed since
        entry("segment_alloc", 10_000, 2_500),
        entry("alloc", 10_000, 2_600),
        entry("alloc", 1000, 3_000),  # the live one
    ], []],
}
STEPS = [Step("graphs", 2.4, 2.7), Step("warm-up", 1.5, 3.5)]


def test_a_site_is_the_innermost_frame_of_ours_else_the_innermost_marked_outside():
    assert site(WARM_UP) == "omni_local/engine/forward/thinker.py:112 warm_up"
    assert site([TORCH_FRAME]) == "outside omni_local: /venv/site-packages/torch/nn/functional.py:99 linear"
    assert site([]) == NO_STACK


def test_live_blocks_are_summed_by_site_largest_first_on_their_device_only():
    sites = by_site(b for _, b in live_blocks(SNAPSHOT, 0))
    assert sites == [("omni_local/engine/memory/kv_store.py:40 for_budget", Total(2048, 1)),
                     ("omni_local/engine/forward/cuda_graphs.py:250 capture_graph", Total(2048, 1)),
                     ("omni_local/engine/forward/thinker.py:112 warm_up", Total(1024, 1)),
                     (NO_STACK, Total(512, 1))]
    assert [pool for pool, _ in live_blocks(SNAPSHOT, 0)] == [(0, 0), (0, 0), (0, 0), GRAPH_POOL]


def test_each_pool_has_its_reserved_bytes_and_those_no_tensor_holds():
    assert unallocated(SNAPSHOT, 0) == {(0, 0): (1024 + 4096, 512 + 1024), GRAPH_POOL: (8192, 6144)}


def test_the_trace_clock_is_fitted_to_the_two_markers_and_is_none_when_one_is_lost():
    wall = wall_clock([(100.0, 1), (102.0, 2)], {1: 5_000, 2: 7_000})
    assert (wall(5_000), wall(6_000), wall(9_000)) == (100.0, 101.0, 104.0)
    assert wall_clock([(100.0, 1), (102.0, 2)], {2: 7_000}) is None


def test_a_moment_belongs_to_the_innermost_step_that_holds_it():
    assert step_at(2.5, STEPS) == "graphs"
    assert step_at(3.0, STEPS) == "warm-up"
    assert step_at(1.0, STEPS) == BETWEEN_STEPS


def test_per_step_holds_each_live_block_by_its_last_allocation_and_each_segment_by_its_cudamalloc():
    held = per_step(SNAPSHOT, 0, lambda us: us / 1000, STEPS)
    assert list(held) == ["graphs", "warm-up", BETWEEN_STEPS, BEFORE_RECORDING]
    assert held["graphs"] == {"sites": [("omni_local/engine/forward/cuda_graphs.py:250 capture_graph", Total(2048, 1))],
                              "reserved": {GRAPH_POOL: 8192}}
    assert held["warm-up"] == {"sites": [("omni_local/engine/forward/thinker.py:112 warm_up", Total(1024, 1))],
                               "reserved": {}}
    assert held[BETWEEN_STEPS] == {"sites": [("omni_local/engine/memory/kv_store.py:40 for_budget", Total(2048, 1))],
                                   "reserved": {(0, 0): 4096}}
    assert held[BEFORE_RECORDING] == {"sites": [(NO_STACK, Total(512, 1))], "reserved": {(0, 0): 1024}}


def test_a_start_up_steps_line_gives_its_window():
    windows, level = StepWindows(), start_up_log.level
    start_up_log.addHandler(windows)
    start_up_log.setLevel(logging.INFO)
    try:
        log_start_up_step("the encoders", 2.5)
    finally:
        start_up_log.removeHandler(windows)
        start_up_log.setLevel(level)
    [step] = windows.steps
    assert (step.name, step.ended - step.began) == ("the encoders", 2.5)


def test_a_graphs_outputs_count_each_storage_once():
    hidden, logits = torch.zeros(4, 8), torch.zeros(3, dtype=torch.float64)
    assert outputs_bytes((hidden, hidden[1:], logits)) == 4 * 8 * 4 + 3 * 8
    assert outputs_bytes(logits) == 24


def test_the_bench_refuses_to_run_without_cuda(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["engine_memory", "--card-gib", "22"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        engine_memory.main()
