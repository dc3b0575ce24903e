"""One launch for a reduction split among programs: the last program to finish adds the parts.

A split-K GEMV's partial sums and a split decode attention's partial softmaxes used to be added by a
second kernel. In a decode step that is 96 more launches, each with its gap on the GPU (an H200's
int4 step: 708 kernels in 3.69 ms of wall time, 2.69 ms of it in kernels). Instead, each program
writes its part, then counts itself in on its output tile's counter; the one that reads the count
before last knows every other part is written, and adds them all in a fixed order (split 0, 1, ...),
so the result does not depend on which program came last: the same bits every run.

The counters are int32 and zero between launches: the last program sets its tile's back to zero,
so the next launch, or the next replay of a CUDA graph holding this one, starts from zero. Kernels
on one stream run one after another, so a stream's launches share one set; each stream has its own.
"""

import torch
import triton
import triton.language as tl

# Counters a stream's set starts with: more than a decode step's tiles (a GEMV's output tiles, a
# batch's sequences x kv heads) need.
FIRST_COUNTERS = 4096

_counters: dict[tuple[torch.device, int], torch.Tensor] = {}
# Sets outgrown: a CUDA graph captured with one keeps its address, so it must never be freed.
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters, zero, for kernels launched on `device`'s current stream."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    counters = _counters.get((device, stream))
    if counters is None or counters.numel() < count:
        if counters is not None:
            _outgrown.append(counters)
        counters = torch.zeros(max(count, FIRST_COUNTERS), dtype=torch.int32, device=device)
        _counters[(device, stream)] = counters
    return counters


@triton.jit
def last_to_arrive(counter_ptr, arrivals):
    """Whether this program is the last of the `arrivals` programs that count on `counter_ptr`;
    if so, every store the others made before counting is visible to it (read their parts with
    cache_modifier=".cg", past this SM's L1), and the counter is back to zero."""
    # Every thread's stores are made before the one thread that counts releases them (acq_rel).
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
