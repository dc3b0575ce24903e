"""How the GPU's memory is split at start-up, decided before any weight is read.

- weights: their exact size in the chosen format (`weights_bytes`, from the empty model);
- working: what the engine takes besides the Thinker's KV blocks: CUDA graphs and their pools, the
  activations of the largest graphed forward, the Talker's and its code predictor's KV, and the
  encoder outputs kept on the device (`encoder_cache_bytes`, reserved whole: they fill up as media
  come). The engine's part is measured at each start (its allocations' peak while it starts, less
  the Thinker's KV) and remembered per GPU, model and settings (<cache_dir>/memory.json);
  a first start takes FIRST_START_ENGINE_BYTES, measured on an H200 at full size;
- KV: the rest, up to `gpu_cache_bytes` (a cap, not a requirement).

What is split is `gpu_memory_bytes`, or by default what the GPU reports free, less MARGIN_BYTES (an
encoder's activations on the largest image or video are not in the measurement). A plan that leaves
less KV than one conversation of `max_context_tokens` stops start-up before loading, with one line
saying what would fit. On the CPU there is no plan unless `gpu_memory_bytes` is set.
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from omni_local.cache.folders import private_folder
from omni_local.engine.thinker import kv_shape, least_kv_bytes
from omni_local.errors import SettingsError
from omni_local.model.quantized import weights_bytes
from omni_local.model.quantized.linear import has_fp8_units
from omni_local.settings import Settings

log = logging.getLogger(__name__)

GiB = 1 << 30
MARGIN_BYTES = 1 * GiB
# The engine's start-up take besides the Thinker's KV, at full size with speech and the default
# settings: 2.6 GiB on an H200 (fp8, allocated after start-up less weights and 4 GiB of KV:
# docs/benchmarks/2026-12-01-quantized-weights.md); rounded up for a first start.
FIRST_START_ENGINE_BYTES = 3 * GiB
# The smallest encoder_cache_bytes a refusal suggests, in steps of ENCODER_CACHE_STEP: a 480x640
# image's outputs take about 6 MiB at full size (some 370 tokens, each its merged row and three
# deepstack levels of 2,048 bfloat16 values: computed), so this keeps about 20 images.
LEAST_ENCODER_CACHE_BYTES = 128 << 20
ENCODER_CACHE_STEP = 64 << 20


@dataclass(frozen=True)
class MemoryPlan:
    available: int
    weights: int
    engine: int  # graphs, activations, the Talker's KV: measured, or FIRST_START_ENGINE_BYTES
    encoder_outputs: int
    kv: int  # the Thinker's KV blocks
    key: str  # what the engine's measurement is remembered under

    def line(self) -> str:
        return (f"GPU memory plan, {size(self.available)}: weights {size(self.weights)}, engine {size(self.engine)}, "
                f"encoder outputs {size(self.encoder_outputs)}, KV {size(self.kv)}")


def plan_memory(model: torch.nn.Module, settings: Settings, device: torch.device) -> MemoryPlan | None:
    """The plan for `model` (full precision, its parameters on the meta device) loaded with
    `settings.weights` on `device`; None where there is nothing to plan (the CPU, unless
    `gpu_memory_bytes` is set). Raises SettingsError naming what would fit where nothing does."""
    available = available_bytes(settings, device)
    if available is None:
        return None
    key = _key(model, settings, device)
    engine = _measured(settings.cache_path).get(key, FIRST_START_ENGINE_BYTES)
    encoder_outputs = settings.encoder_cache_bytes if settings.encoder_cache else 0
    fixed = engine + encoder_outputs
    least_kv = least_conversation_kv_bytes(model, settings, next(model.parameters()).dtype)
    weights = weights_bytes(model, settings.weights, settings.speech)
    if weights + fixed + least_kv > available:
        raise SettingsError(_refusal(model, settings, device, available, fixed + least_kv, weights, encoder_outputs))
    kv = min(settings.gpu_cache_bytes, available - weights - fixed)
    return MemoryPlan(available, weights, engine, encoder_outputs, kv, key)


def least_conversation_kv_bytes(model: torch.nn.Module, settings: Settings, dtype: torch.dtype) -> int:
    """The Thinker's KV blocks for one conversation of `max_context_tokens` (and the pad block)."""
    talker_dim = model.config.talker_config.text_config.hidden_size if settings.speech else 0
    shape = kv_shape(model.thinker.model.language_model.config, settings.max_context_tokens, settings.kv_block_tokens,
                     talker_dim)
    return least_kv_bytes(shape, dtype)


def size(count: int) -> str:
    return f"{count / GiB:.1f} GiB" if count >= GiB else f"{count / (1 << 20):.1f} MiB"


def available_bytes(settings: Settings, device: torch.device) -> int | None:
    if settings.gpu_memory_bytes:
        return settings.gpu_memory_bytes
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free - MARGIN_BYTES


def engine_baseline(device: torch.device) -> int:
    """Before the engine starts: the bytes allocated already (the weights, and whatever else the
    process holds), the peak counted from here."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def remember_engine_bytes(plan: MemoryPlan, settings: Settings, device: torch.device, baseline: int,
                          kv_bytes: int) -> None:
    """After the engine's warm-up, every graph captured: its measured take at its peak since
    `baseline` (engine_baseline), less the Thinker's KV, for the next start's plan. A request served
    while the prefill graphs were captured counts too, its activations and encoder outputs: the
    next plan keeps more for the engine than it needs, never less."""
    if device.type != "cuda":
        return
    engine = torch.cuda.max_memory_allocated(device) - baseline - kv_bytes
    measured = _measured(settings.cache_path)
    measured[plan.key] = engine
    file = private_folder(settings.cache_path) / "memory.json"
    written = file.with_name(f"memory.json.{os.getpid()}")
    try:
        written.write_text(json.dumps(measured), encoding="utf-8")
        os.replace(written, file)
    except OSError as error:  # a full disk: the next start plans with what it knew
        written.unlink(missing_ok=True)
        log.warning("could not keep the engine's measured memory in '%s': %s", file, error)
    log.info("the engine took %s besides the weights and KV (planned: %s)", size(engine), size(plan.engine))


def _refusal(model: torch.nn.Module, settings: Settings, device: torch.device, available: int, rest: int,
             weights: int, encoder_outputs: int) -> str:
    """One line: what the settings need, what is free, and the changes that would fit (the fewest;
    first a smaller encoder cache, which keeps the format and speech)."""
    formats = [f for f in ("bf16", "fp8", "int4") if f != "fp8" or _fp8_runs(device)]
    speech = [True, False] if settings.speech else [False]
    fits = [(f, s) for s in speech for f in formats if weights_bytes(model, f, s) + rest <= available]
    changes = [_change(settings, f, s) for f, s in fits]
    room = (available - weights - (rest - encoder_outputs)) // ENCODER_CACHE_STEP * ENCODER_CACHE_STEP
    if encoder_outputs and room >= LEAST_ENCODER_CACHE_BYTES:
        changes.insert(0, f"encoder_cache_bytes = {room} ({size(room)})")
    fewest = [c for c in changes if c.count(" and ") == min(c.count(" and ") for c in changes)] if changes else []
    advice = (f": try {' or '.join(fewest)}" if fewest else
              ": no weights format fits; lower encoder_cache_bytes or max_context_tokens, or use a larger GPU")
    return (f"the model needs {size(weights + rest)} of GPU memory (weights {size(weights)}, the engine, encoder "
            f"outputs and one conversation's KV {size(rest)}), {size(available)} is free{advice}")


def _change(settings: Settings, weights: str, speech: bool) -> str:
    return " and ".join([*([f"weights = '{weights}'"] if weights != settings.weights else []),
                         *(["speech = false"] if speech != settings.speech else [])])


def _fp8_runs(device: torch.device) -> bool:
    return device.type != "cuda" or has_fp8_units(device)


def _key(model: torch.nn.Module, settings: Settings, device: torch.device) -> str:
    """A full-length digest of what the engine's take depends on: the GPU, the model's dimensions, and
    the settings that size graphs, activations and the Talker's KV."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    parts = {"gpu": gpu, "config": model.config.to_json_string(use_diff=False), "settings": {
        name: getattr(settings, name) for name in (
            "weights", "speech", "dtype", "max_context_tokens", "max_running_requests", "cuda_graphs",
            "compiled_layers", "prefill_chunk_tokens", "prefill_forward_tokens", "kv_block_tokens",
            "gpu_cache_bytes", "moe_backend", "attention_backend")}}
    return blake3.blake3(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _measured(cache_dir: Path) -> dict[str, int]:
    try:
        measured = json.loads((cache_dir / "memory.json").read_text(encoding="utf-8"))
        return {k: int(v) for k, v in measured.items()} if isinstance(measured, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}
