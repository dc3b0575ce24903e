"""Host memory and time taken to load a checkpoint.

    python -m omni_local.bench.load_memory CHECKPOINT [--device cuda] [--dtype bfloat16] [--speech] [--weights int4]
    python -m omni_local.bench.load_memory CHECKPOINT --loader transformers    # from_pretrained, then .to

The process's resident memory is split as Linux counts it: anonymous memory (what the loader
allocates on the host) and file-backed pages (the memory-mapped shards' pages once read: file cache,
which the kernel can drop). Growth is measured from just before the load. The anonymous peak is
sampled every half millisecond (Linux keeps no peak of it); the total peak is the kernel's own
(VmHWM, reset before the load). On the CPU the model itself lives in host memory: its bytes are
printed beside, and what stays allocated after the load is the model's.
"""

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omni_local.model.demo import LOAD_TEST, ensure_demo_checkpoint
from omni_local.model.loader import load_model, quiet_library_logs, resolve_device, resolve_dtype
from omni_local.model.weights import weight_files
from omni_local.settings import Settings

_SAMPLE_S = 0.0005


@dataclass(frozen=True)
class LoadMemory:
    loader: str
    device: str
    load_s: float
    anon_peak_bytes: int  # growth of anonymous memory at its sampled peak
    anon_after_bytes: int  # growth still held once loaded
    rss_peak_bytes: int  # growth of the whole RSS at its peak, the shards' file pages included
    model_host_bytes: int  # the loaded model's parameters and buffers in host memory
    largest_tensor_bytes: int  # the largest tensor in the checkpoint's files
    checkpoint_bytes: int


def measure(checkpoint: Path, loader: str, device: str, dtype: str, speech: bool, weights: str = "bf16",
            cache_dir: Path | None = None) -> LoadMemory:
    """Load `checkpoint` once with `loader` ("omni_local" or "transformers") and measure it; with
    quantized `weights`, the quantized layers are kept in `cache_dir` (a temporary folder if None:
    the first load quantizes, and writes them there, as a first start does)."""
    load = _LOADERS[loader]
    if cache_dir is None:
        cache_dir = Path(tempfile.mkdtemp(prefix="omni_local-load-memory-"))
    settings = Settings(model=str(checkpoint), device=device, dtype=dtype, speech=speech, weights=weights,
                        cache_dir=str(cache_dir))
    baseline = _memory()
    _reset_peak_rss()
    sampler = _PeakSampler()
    start = time.perf_counter()
    with sampler:
        model = load(settings)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    after = _memory()
    return LoadMemory(
        loader=loader,
        device=str(resolve_device(device)),
        load_s=load_s,
        anon_peak_bytes=max(sampler.anon_peak, after["RssAnon"]) - baseline["RssAnon"],
        anon_after_bytes=after["RssAnon"] - baseline["RssAnon"],
        rss_peak_bytes=after["VmHWM"] - baseline["VmRSS"],
        model_host_bytes=_host_bytes(model),
        largest_tensor_bytes=max(_tensor_bytes(checkpoint)),
        checkpoint_bytes=sum(_tensor_bytes(checkpoint)),
    )


def _load_streamed(settings: Settings) -> torch.nn.Module:
    return load_model(settings).model


def _load_with_from_pretrained(settings: Settings) -> torch.nn.Module:
    # What the loader did before it streamed: the whole model built on the host, then moved.
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    device = resolve_device(settings.device)
    config = Qwen3OmniMoeConfig.from_pretrained(settings.model)
    config.enable_audio_output = settings.speech
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        settings.model, config=config, dtype=resolve_dtype(settings.dtype, device)
    )
    return model.to(device)


_LOADERS: dict[str, Callable[[Settings], torch.nn.Module]] = {
    "omni_local": _load_streamed,
    "transformers": _load_with_from_pretrained,
}


class _PeakSampler:
    """The highest RssAnon seen while the `with` block runs, read from /proc every half millisecond."""

    def __init__(self) -> None:
        self.anon_peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "_PeakSampler":
        # The loading thread gives up the interpreter this often, so the sampler runs between tensors.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(_SAMPLE_S / 5)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    def _sample(self) -> None:
        while not self._done.wait(_SAMPLE_S):
            self.anon_peak = max(self.anon_peak, _memory()["RssAnon"])


def _memory() -> dict[str, int]:
    """/proc/self/status's memory fields, in bytes."""
    status = Path("/proc/self/status").read_text()
    return {key: int(kib) << 10 for key, kib in re.findall(r"^(Vm\w+|Rss\w+):\s+(\d+) kB", status, re.M)}


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current RSS


def _host_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    return sum(storages.values())


def _tensor_bytes(checkpoint: Path) -> list[int]:
    """The size of every tensor in the checkpoint's files, read from their headers."""
    sizes = []
    for file in weight_files(checkpoint):
        with file.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__":
                start, end = entry["data_offsets"]
                sizes.append(end - start)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.load_memory", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the checkpoint's folder (with --write-load-test: written there "
                        "first, unless there already)")
    parser.add_argument("--write-load-test", action="store_true",
                        help="write a checkpoint of several GB there first (the demo's LOAD_TEST size, sharded bf16)")
    parser.add_argument("--loader", choices=sorted(_LOADERS), default="omni_local")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--speech", action="store_true", help="load the Talker and Code2Wav too")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "int4"],
                        help="quantize as it loads (the first start's path: its store written to --cache-dir)")
    parser.add_argument("--cache-dir", type=Path, help="where quantized layers are kept (default: a new temporary "
                        "folder, so the load quantizes; give the same one twice to time reading them back)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    quiet_library_logs()
    if args.write_load_test:
        ensure_demo_checkpoint(args.checkpoint, LOAD_TEST)
    result = measure(args.checkpoint, args.loader, args.device, args.dtype, args.speech, args.weights, args.cache_dir)
    if args.json:
        print(json.dumps(asdict(result)))
        return
    print(f"{result.loader} on {result.device}, weights {args.weights}: loaded in {result.load_s:.2f} s")
    print(f"  anonymous memory growth: peak {_mib(result.anon_peak_bytes)}, after {_mib(result.anon_after_bytes)}")
    print(f"  RSS growth at peak (file pages included): {_mib(result.rss_peak_bytes)}")
    print(f"  model in host memory: {_mib(result.model_host_bytes)}")
    print(f"  checkpoint: {_mib(result.checkpoint_bytes)}, its largest tensor {_mib(result.largest_tensor_bytes)}")


def _mib(size: int) -> str:
    return f"{size / (1 << 20):,.1f} MiB"


if __name__ == "__main__":
    main()
