"""One launch for a reduction split among programs: the last program to finish adds the parts.

A split-K GEMV's partial sums and a split decode attention's partial softmaxes need adding once
every split is done. A second kernel to add them would be one more launch, and one more gap on the
GPU, for every split product in a decode step (a layer's GEMVs and its attention). Instead, each
program writes its part, then counts itself in on its output tile's counter; the one that reads the
count before last knows every other part is written, and adds them all in a fixed order (split 0,
1, ...), so the result does not depend on which program came last: the same bits every run.

The counters are int32 and zero between launches: the last program sets its tile's back to zero,
so the next launch, or the next replay of a CUDA graph holding this one, starts from zero. That
holds while the launches holding one set run one after another, which is why a set belongs to one
stream (kernels on a stream run in order). A CUDA graph keeps the set of the stream it was captured
on and replays on the stream current at replay: the engine captures and replays its graphs one at a
time (at start-up, then on its worker thread), so no two of them ever run at once. Torch hands out pooled side
streams by id, so two graphs captured on side streams of one id share a set: the same rule covers
them.
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
