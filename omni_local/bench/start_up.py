"""One start-up from a checkpoint on disk, to ready, in this fresh process: one table row.

    python -m omni_local.bench.start_up --model FOLDER --weights int4 --speech true --cache-dir DIR

Run it twice on the same --cache-dir: the first start reads the bf16 checkpoint and quantizes it,
writing the quantized layers' store, and compiles; the second reads the store and finds its compiled
code in the compile caches (Inductor's and Triton's, under the user's temporary and home folders). A
full-size checkpoint for it: bench/full_size_checkpoint.py.

Columns: imports (torch, transformers and ours), start (`OmniLocal(settings, wait_for_graphs=False)`,
as the app starts: the memory plan, the load, and the engine's start: KV, warm-up, compiled layers,
the decode steps' CUDA graphs), ready (the two, from this module's first line: the engine serves),
warm (also the prefill graphs, captured after ready while the engine is idle); whether the quantized
layers came from their store. The start's steps, each
with its seconds, go to stderr (start_up_steps.py). Host memory while loading is
bench/load_memory.py's.
"""

import time

_BEGUN = time.perf_counter()

import argparse  # noqa: E402 (after the clock starts)

import torch  # noqa: E402

from omni_local.api import OmniLocal  # noqa: E402
from omni_local.model.loader import quiet_library_logs  # noqa: E402
from omni_local.model.quantized.stored import filled_from_disk  # noqa: E402
from omni_local.settings import add_settings_arguments, settings_from_arguments  # noqa: E402
from omni_local.start_up_steps import show_start_up_steps  # noqa: E402

HEAD = ("| weights | speech | quantized layers | imports s | start s | ready s | warm s |\n"
        "| --- | --- | --- | --- | --- | --- | --- |")


def main() -> None:
    imported = time.perf_counter()
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.start_up")
    add_settings_arguments(parser)
    settings = settings_from_arguments(parser.parse_args())
    quiet_library_logs()
    show_start_up_steps()
    with OmniLocal(settings, wait_for_graphs=False) as app:
        if app.backend.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        ready = time.perf_counter()
        app.backend.engine.warm.wait()
        warm = time.perf_counter()
        model = app.backend.loaded.model
        store = ("from their store" if filled_from_disk(model) else "quantized on load") \
            if settings.weights != "bf16" else "-"
    print(HEAD)
    print(f"| {settings.weights} | {'on' if settings.speech else 'off'} | {store} | {imported - _BEGUN:.1f} | "
          f"{ready - imported:.1f} | {ready - _BEGUN:.1f} | {warm - _BEGUN:.1f} |")


if __name__ == "__main__":
    main()
