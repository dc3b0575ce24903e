"""Where a start-up's time and GPU memory go: each step's seconds and what it left allocated and
reserved on the GPU, logged as it ends ("start-up: the Thinker's CUDA graphs, 12.3 s, GPU +412.0 MiB
allocated, +640.0 MiB reserved"), from the load (model/) to the engine's warm-up (engine/).
bench/start_up.py prints them; the app's log has them at INFO. The memory plan (engine/sizing/memory_plan.py)
sizes the engine's share from the whole; these say which part of it is which."""

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger("omni_local.start_up")


@contextmanager
def start_up_step(name: str) -> Iterator[None]:
    """Logs the seconds the block took, the GPU's queued work included, and the GPU memory it kept."""
    began, memory = time.perf_counter(), gpu_memory()
    yield
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    log_start_up_step(name, time.perf_counter() - began, memory)


def gpu_memory() -> tuple[int, int] | None:
    """The current GPU's bytes allocated to tensors and reserved by its caching allocator (CUDA
    graphs' private pools included: what the card no longer has free); None before CUDA is used."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def log_start_up_step(name: str, seconds: float, memory_before: tuple[int, int] | None = None) -> None:
    """One step's line; with `memory_before` (gpu_memory() as the step began), what it kept."""
    now = gpu_memory() if memory_before is not None else None
    if now is None:
        log.info("start-up: %s, %.1f s", name, seconds)
        return
    allocated, reserved = (after - before for after, before in zip(now, memory_before))
    log.info("start-up: %s, %.1f s, GPU %s allocated, %s reserved", name, seconds, _signed(allocated),
             _signed(reserved))


def _signed(count: int) -> str:
    return f"{'+' if count >= 0 else '-'}{abs(count) / (1 << 20):,.1f} MiB"


def show_start_up_steps() -> None:
    """The steps' lines to stderr, whatever the logging set-up (the benches')."""
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.INFO)
