"""Where a start-up's time goes: each step's seconds, logged as it ends ("start-up: the Thinker's CUDA
graphs, 12.3 s"), from the load (model/) to the engine's warm-up (engine/). bench/start_up.py prints
them; the app's log has them at INFO."""

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger("omni_local.start_up")


@contextmanager
def start_up_step(name: str) -> Iterator[None]:
    """Logs the seconds the block took, the GPU's queued work included."""
    began = time.perf_counter()
    yield
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    log_start_up_step(name, time.perf_counter() - began)


def log_start_up_step(name: str, seconds: float) -> None:
    log.info("start-up: %s, %.1f s", name, seconds)


def show_start_up_steps() -> None:
    """The steps' lines to stderr, whatever the logging set-up (the benches')."""
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.INFO)
