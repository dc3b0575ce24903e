"""What compiles or is captured while a block of code runs: the first-use costs a warm start-up
should have paid (profile_turn --first-use prints it beside the turn's profile).

- dynamo's compiles (torch.compile'd regions meeting new shapes or guards), their count and
  summed seconds, from torch's own compile-time metrics;
- Triton kernels our code launches that Triton compiled anew (a new constexpr, or an integer
  argument's new specialization), by kernel name; inductor's kernels compile inside dynamo's time;
- CUDA graphs captured.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch._dynamo.utils as dynamo_utils


@dataclass
class CompileLog:
    """What compiled or was captured while a `compile_log` block ran."""

    dynamo_compiles: int = 0
    dynamo_seconds: float = 0.0
    triton_kernels: list[str] = field(default_factory=list)  # each compile's kernel and specialization
    graph_captures: int = 0

    def summary(self) -> str:
        """One line: the counts, or that nothing compiled or was captured."""
        said = []
        if self.dynamo_compiles:
            said.append(f"dynamo compiled {self.dynamo_compiles} graph(s) in {self.dynamo_seconds:.2f} s")
        if self.triton_kernels:
            names = Counter(kernel.split("[", 1)[0] for kernel in self.triton_kernels)
            said.append(f"Triton compiled {len(self.triton_kernels)} kernel(s): "
                        + ", ".join(f"{name} {count}x" for name, count in names.most_common()))
        if self.graph_captures:
            said.append(f"{self.graph_captures} CUDA graph(s) captured")
        return "; ".join(said) or "nothing compiled or captured"


_COMPILE = "_compile.compile_inner"  # one entry per frame dynamo compiles, its seconds


@contextmanager
def compile_log() -> Iterator[CompileLog]:
    """A CompileLog filled in as the block runs (complete once it exits)."""
    log = CompileLog()
    compiled_before = list(dynamo_utils.compilation_time_metrics.get(_COMPILE, []))
    restore_hook = _watch_triton(log)
    capture_begin = torch.cuda.CUDAGraph.capture_begin

    def counted_capture(graph: torch.cuda.CUDAGraph, *args: object, **kwargs: object) -> None:
        log.graph_captures += 1
        capture_begin(graph, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counted_capture
    try:
        yield log
    finally:
        torch.cuda.CUDAGraph.capture_begin = capture_begin
        restore_hook()
        new = dynamo_utils.compilation_time_metrics.get(_COMPILE, [])[len(compiled_before):]
        log.dynamo_compiles, log.dynamo_seconds = len(new), float(sum(new))


def _watch_triton(log: CompileLog):
    """Count Triton's compiles into `log`; returns what undoes it (nothing where Triton is absent)."""
    try:
        from triton import knobs
    except ImportError:
        return lambda: None
    before = knobs.runtime.jit_post_compile_hook

    def compiled(*args: object, **kwargs: object) -> None:
        log.triton_kernels.append(str(kwargs.get("repr", "a kernel")))
        if before is not None:
            before(*args, **kwargs)

    knobs.runtime.jit_post_compile_hook = compiled

    def restore() -> None:
        knobs.runtime.jit_post_compile_hook = before

    return restore
