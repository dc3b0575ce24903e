"""GPU time of a call: the median of many runs, each between two CUDA events, with the L2 cache
flushed before each (a decode step reads 48 layers' weights between two calls of one layer, so
none is left there)."""

import statistics
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # above any current GPU's L2 (H200: 60 MiB)


def median_cuda_ms(call: Callable[[], object], runs: int, warmup: int = 3) -> float:
    """Median milliseconds of `call` on the current CUDA stream over `runs` runs, after `warmup`."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        call()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        flush.zero_()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
