"""What the benchmarks share: their command line, the model they time, a synchronised clock, medians."""

import argparse
import importlib
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from omni_local.api import OmniLocal
from omni_local.bench.random_weights import load_random_weights
from omni_local.listening import listening
from omni_local.model.loader import LoadedModel, load_model, quiet_library_logs
from omni_local.settings import Settings, add_settings_arguments, settings_from_arguments


def bench_parser(prog: str, timed: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--random-weights", type=Path, help="a full-size config.json, built with random weights")
    if timed:
        parser.add_argument("--runs", type=int, default=5, help="timed runs per row, after one warm-up run")
    add_settings_arguments(parser)
    return parser


def settings_and_model(args: argparse.Namespace) -> tuple[Settings, LoadedModel]:
    """The settings, and the model loaded once: random full-size weights, or the configured checkpoint."""
    quiet_library_logs()
    settings = settings_from_arguments(args)
    return settings, bench_model(settings, args.random_weights)


def bench_model(settings: Settings, random_weights: Path | None) -> LoadedModel:
    """The model of `settings`: random weights at the `random_weights` config's size, or the configured checkpoint."""
    return load_random_weights(random_weights, settings) if random_weights else load_model(settings)


# What `served` and the `openai` SDK's clients import: fastapi (through the server's routes, with
# what it imports in turn, such as opentelemetry-api), uvicorn, the SDK and its realtime client's
# websockets.
SERVING_MODULES = ("uvicorn", "omni_local.server.routes", "openai", "websockets")


def require_modules(names: tuple[str, ...], needed_by: str) -> None:
    """Imports `names` now: where one does not import, the bench stops at once, naming it, not after
    minutes of building full-size weights (a GPU machine's image may lack the server's packages)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as error:
            sys.exit(f"{needed_by} needs '{error.name or name}', which does not import here: {error}")


@contextmanager
def served(app: OmniLocal) -> Iterator[str]:
    """`app`'s API as `serve` serves it, at the returned URL, on a free port of this machine."""
    # Imported here: benches that call the API in-process need none of the server's packages (a GPU
    # machine may lack them).
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from omni_local.server.hosts import HostCheck, ServedNames
    from omni_local.server.routes import API_PATH, api_mount

    bound = listening("127.0.0.1", 0, "a bench's server")
    names = ServedNames("127.0.0.1", "")
    asgi = Starlette(routes=[api_mount(app, None)], middleware=[Middleware(HostCheck, names=names)])
    server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [bound]}, name="bench server")
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the bench's server did not start (its error is above)")
    try:
        yield f"http://127.0.0.1:{bound.getsockname()[1]}{API_PATH}"
    finally:
        server.should_exit = True
        thread.join()


def elapsed_s(call: Callable[[], object]) -> float:
    """Wall time of `call`, the GPU's queued work included."""
    start = synced_now()
    call()
    return synced_now() - start


def median_wall_ms(call: Callable[[], object], runs: int) -> float:
    """Median milliseconds of `call` over `runs` calls, after one warm-up call."""
    call()
    return statistics.median(elapsed_s(call) * 1e3 for _ in range(runs))


def synced_now() -> float:
    """The clock, read once the GPU's queued work is done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median of the samples that have a value (a reply of one token has no ITL)."""
    return {key: _median([s[key] for s in samples]) for key in samples[0]}


def _median(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan
