"""How the GPU's memory is split at start-up, decided before any weight is read.

- weights: their exact size in the chosen format (`weights_bytes`, from the empty model), less the
  experts the plan puts in host memory;
- engine: what the engine takes besides the KV and the encoder outputs: CUDA graphs and their pools,
  the activations of the largest graphed forward, the code predictor's KV. Measured at each start
  (the memory it reserved at its peak while it starts, less the Thinker's and the Talker's KV: what
  the card no longer has, where a graph's pool keeps more than its tensors take) and remembered per
  GPU, model and settings (<cache_dir>/memory.json); a first start takes FIRST_START_ENGINE_BYTES,
  measured at full size on an H100 (int4). Each start-up step logs its own part (start_up_steps.py);
- encoder outputs and KV: caches, so caps the plan shrinks to fit, each down to a floor it states.
  The KV is the Thinker's blocks and, with speech, the Talker's KV beside them (kv_sizes.py: as many
  Talker sequences as the Thinker's blocks hold chats of `max_context_tokens`). It first gets
  KV_TARGET_TOKENS, twice as many with fp8 KV (or `gpu_cache_bytes`, if less), then the encoder
  outputs up to `encoder_cache_bytes` (reserved whole on the device: they fill up as media come),
  then the KV the rest, up to `gpu_cache_bytes` of the Thinker's, and what its whole blocks leave
  goes to the encoder outputs too. Chats are worth more than resent images: on a small card the
  encoder outputs shrink to LEAST_ENCODER_CACHE_BYTES before the KV holds fewer than four chats.

What is split is `gpu_memory_bytes`, or by default what the GPU reports free, less MARGIN_BYTES (what
CUDA takes outside torch's allocator, and a request's transient memory: neither is in the engine's
measurement). Where the weights leave less than the KV target (beside the engine and the encoder
outputs' floor), the Thinker's input embeddings go to host memory (model/host_experts.py): a token
reads one row of them over the bus. Where the KV target still does not fit, the prefill graphs
shrink: `prefill_forward_tokens` halves (down to `prefill_chunk_tokens`) until it does, as the
largest graphed prefill's activations are the part of the engine's take that grows with it
(`prefill_bytes_per_token`); a long prompt then takes more forwards, each reading the experts again,
where moving experts would slow every token.
Where the weights and the floors (the engine's, the encoder outputs' and one conversation of
`max_context_tokens`) still do not fit, the routed experts of the Thinker's last layers go there too
(`experts_on_gpu` = -1): the fewest layers that make the floors fit. Decode then reads each token's
routed experts of those layers over the bus, which the plan's line counts; page-locked, these weights
may take at most half the machine's memory (expert_placement.py). Where even that does not fit (or
`experts_on_gpu` = N keeps too many on the GPU), start-up stops before loading, with one line saying
what would fit. On the CPU there is no plan unless `gpu_memory_bytes` is set.
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import blake3
import torch

from omni_local.engine.forward.speech import talker_sequences
from omni_local.engine.forward.thinker import least_kv_bytes
from omni_local.engine.memory.kv_fp8 import fp8_kv
from omni_local.engine.sizing.expert_placement import (BUS_BYTES_PER_S, HOST_SHARE, Placement, bus_bytes_per_token,
                                                embeddings_bytes, host_experts_most, place_weights)
from omni_local.engine.sizing.kv_sizes import KVSizes, kv_sizes
from omni_local.errors import SettingsError
from omni_local.folders import private_folder
from omni_local.model.host_experts import AUTO
from omni_local.model.quantized import weights_bytes
from omni_local.model.quantized.linear import has_fp8_units
from omni_local.settings import EngineConfig

log = logging.getLogger(__name__)
# What a plan is applied to: the engine's settings, or all of them (which a plan keeps whole).
Planned = TypeVar("Planned", bound=EngineConfig)

GiB = 1 << 30
# What the plan leaves of the GPU's free memory, for what the engine's measured take does not hold,
# measured at full size, int4 with speech, on an H100 (docs/benchmarks/2026-12-07-margin-h100.md):
# - what start-up and serving take outside torch's caching allocator (CUDA's kernel modules as they
#   load, graph executables, library handles): 386 MiB;
# - a request's transient memory (its pixels, the encoders' activations, its prefill's), which grows
#   with its image tokens, about 230 KiB each: the other 382 MiB hold about 1,700 (several photos,
#   or a short video). A request of more, on a card the plan fills, is refused with "out of memory:
#   try a shorter conversation, a smaller image or clip" and the engine goes on; the most a default
#   prompt holds, 5,832, took 1,311.
# At 22 GiB this margin kept the prefill graphs at 512 tokens, where 640 MiB let the plan choose
# 1,024-token graphs whose capture then ran out of memory (same file). Those runs capped torch's
# allocator alone: counting the 386 MiB against the card too, 22 GiB did not serve at this margin,
# as the engine's graphs reserved about 700 MiB beyond what its take had counted
# (docs/benchmarks/2026-12-08-honest-cap-h100.md); the margin that serves is still to be measured.
MARGIN_BYTES = 768 << 20
# The engine's start-up take besides the KV, at full size with speech and the default settings, on an
# H100 with int4 weights (docs/benchmarks/2026-12-07-engine-take-h100.md): its CUDA graph pools
# reserved 1,038 MiB (the Thinker's decode and prefill graphs, of up to 4,096 tokens, 920; Code2Wav
# 114; the Talker 4) and it allocated about 165 MiB outside them (graphs' static inputs, the Talker's
# split projections, activations kept, sampling rows): 1.17 GiB, rounded up for a first start. (It
# was 2 GiB, from an H200 run with fp8 weights at an earlier commit; not measured again since.)
FIRST_START_ENGINE_BYTES = 1_280 << 20
# The start-up step that captures the prefill graphs reserved 828 MiB with graphs of up to 4,096 tokens
# and 164 MiB with graphs of up to 512: 664 MiB, 190 KiB a token, where the activations computed for a
# token (prefill_bytes_per_token) are 132 KiB: the graphs' pool also keeps each graph's outputs and
# what one capture could not reuse of another's. Measured on an H100, int4, speech on, at f31db87
# and 3de197f (docs/benchmarks/2026-12-07-engine-take-h100.md, 2026-12-07-cards-22-14-gib-idle-h100.md).
PREFILL_POOL_OVER_ACTIVATIONS = 190 / 132
# The encoder outputs' floor where memory is short (or encoder_cache_bytes, if less): a 480x640
# image's outputs take about 6 MiB at full size (some 370 tokens, each its merged row and three
# deepstack levels of 2,048 bfloat16 values: computed), so this keeps about 20 images.
LEAST_ENCODER_CACHE_BYTES = 128 << 20
# The KV the plan gives before the encoder outputs grow past their floor: four chats of 4,096 tokens.
KV_TARGET_TOKENS = 16_384
CHAT_TOKENS = 4096  # the chat the plan's line counts the KV in


@dataclass(frozen=True)
class MemoryPlan:
    available: int
    weights: int  # on the GPU
    engine: int  # graphs, activations: measured, or FIRST_START_ENGINE_BYTES
    encoder_outputs: int  # up to encoder_cache_bytes
    encoder_cap: int  # encoder_cache_bytes (0 with the encoder cache off)
    kv: int  # the Thinker's KV blocks, up to gpu_cache_bytes
    kv_tokens: int  # the tokens those blocks hold
    talker_kv: int  # the Talker's KV beside them (0 without speech)
    talker_chats: int  # the spoken chats of max_context_tokens it holds
    context_tokens: int  # max_context_tokens
    key: str  # what the engine's measurement is remembered under
    experts_on_gpu: int  # the first Thinker layers whose experts stay on the GPU; the rest in host memory
    layers: int  # the Thinker's layers
    host_experts: int  # the bytes of the experts in host memory (not in `weights`)
    host_embeddings: int  # the bytes of the Thinker's input embeddings in host memory (0: on the GPU)
    bus_bytes_per_token: int  # of them, what a decoded token reads: its routed experts, its embedding row
    prefill_forward_tokens: int  # the longest prefill forward, and graph (the setting's, or less: shrunk to fit)
    prefill_forward_setting: int  # the setting's

    def line(self) -> str:
        shrunk = f" (of {size(self.encoder_cap)}: shrunk to fit)" if self.encoder_outputs < self.encoder_cap else ""
        return (f"GPU memory plan, {size(self.available)}: weights {size(self.weights)}{self._host_part()}, engine "
                f"{size(self.engine)}, encoder outputs {size(self.encoder_outputs)}{shrunk}, KV {size(self.kv)} "
                f"({self.kv_tokens:,} tokens: {self.kv_tokens / CHAT_TOKENS:.1f} chats of {CHAT_TOKENS:,})"
                f"{self._talker_part()}{self._prefill_part()}")

    def _prefill_part(self) -> str:
        if self.prefill_forward_tokens == self.prefill_forward_setting:
            return ""
        return (f"; prefill graphs of up to {self.prefill_forward_tokens:,} tokens (prefill_forward_tokens "
                f"{self.prefill_forward_setting:,}: shrunk to fit)")

    def _host_part(self) -> str:
        host = self.layers - self.experts_on_gpu
        parts = ([f"the input embeddings, {size(self.host_embeddings)}"] if self.host_embeddings else []) + (
            [f"the experts of the last {host} of {self.layers} layers, {size(self.host_experts)}"] if host else [])
        if not parts:
            return ""
        bound = (f", at most {BUS_BYTES_PER_S / self.bus_bytes_per_token:,.0f} tokens/s at "
                 f"{BUS_BYTES_PER_S / 1e9:.0f} GB/s" if host else "")
        return f" (in host memory: {'; '.join(parts)}: {_bus(self.bus_bytes_per_token)} over the bus a decoded token{bound})"

    def _talker_part(self) -> str:
        if not self.talker_kv:
            return ""
        chats = f"{self.talker_chats:,} spoken chat{'' if self.talker_chats == 1 else 's'}"
        return f", and the Talker's KV {size(self.talker_kv)} ({chats} of {self.context_tokens:,})"

    def out_of_memory_at_start(self) -> str:
        """What to change where the engine ran out of GPU memory while it started: half the KV, where
        half still holds a conversation of `max_context_tokens`."""
        change = (f"gpu_cache_bytes = {self.kv // 2}" if self.kv_tokens // 2 >= self.context_tokens
                  else "speech = false, or a lower max_context_tokens")
        return (f"the GPU ran out of memory while the engine started, with {size(self.kv)} of KV planned "
                f"({self.kv_tokens:,} tokens): more than the plan's margin went to CUDA and the engine's "
                f"graphs on this GPU; try {change}")

    def applied(self, settings: Planned) -> Planned:
        """`settings` with the caches as planned."""
        return settings.replace(gpu_cache_bytes=self.kv, encoder_cache_bytes=self.encoder_outputs or
                                settings.encoder_cache_bytes, prefill_forward_tokens=self.prefill_forward_tokens)


def plan_memory(model: torch.nn.Module, settings: EngineConfig, device: torch.device) -> MemoryPlan | None:
    """The plan for `model` (full precision, its parameters on the meta device) loaded with
    `settings.weights` on `device`; None where there is nothing to plan (the CPU, unless
    `gpu_memory_bytes` is set). Raises SettingsError naming what would fit where nothing does."""
    fp8_kv(settings.kv_dtype, device)  # refused before the weights load where the GPU has no FP8
    forward_setting = settings.prefill_forward_tokens
    available = available_bytes(settings, device)
    if available is None:
        return None
    encoder_cap = settings.encoder_cache_bytes if settings.encoder_cache else 0
    least_encoder = min(encoder_cap, LEAST_ENCODER_CACHE_BYTES)
    kv = kv_sizes(model, settings)
    first_kv = kv.bytes(max(kv.least_blocks, _target_blocks(kv, settings)))  # the KV target, or the floor if more
    settings, engine = _prefill_sized(model, settings, device, available - least_encoder - first_kv)
    key = _key(model, settings, device)
    floors = engine + least_encoder + kv.bytes(kv.least_blocks)
    host_most = host_experts_most()
    placed = place_weights(model, settings.weights, settings.speech, settings.experts_on_gpu, available - floors,
                           available - engine - least_encoder - first_kv)
    if not placed.fits(available - floors, host_most):
        raise SettingsError(_refusal(model, settings, device, available, floors, least_encoder, placed, host_most))
    room = available - placed.device_weights - engine
    encoder_first = min(encoder_cap, max(least_encoder, room - first_kv))
    blocks = kv.most_blocks(room - encoder_first, settings.gpu_cache_bytes)
    # What the KV's whole blocks leave (less than a block, or a Talker sequence it stopped short of)
    # holds encoder outputs too.
    encoder_outputs = min(encoder_cap, room - kv.bytes(blocks))
    spoken = talker_sequences(kv.tokens(blocks), settings.max_context_tokens) if settings.speech else 0
    return MemoryPlan(
        available=available, weights=placed.device_weights, engine=engine, encoder_outputs=encoder_outputs,
        encoder_cap=encoder_cap, kv=blocks * kv.block_bytes, kv_tokens=kv.tokens(blocks),
        talker_kv=kv.talker_bytes(blocks), talker_chats=spoken, context_tokens=settings.max_context_tokens, key=key,
        experts_on_gpu=placed.experts_on_gpu, layers=placed.layers, host_experts=placed.host_experts,
        host_embeddings=placed.host_embeddings,
        bus_bytes_per_token=bus_bytes_per_token(model, settings.weights, placed.host_layers, placed.host_embeddings > 0),
        prefill_forward_tokens=settings.prefill_forward_tokens, prefill_forward_setting=forward_setting)


def _prefill_sized(model: torch.nn.Module, settings: EngineConfig, device: torch.device, room: int
                   ) -> tuple[EngineConfig, int]:
    """`settings` with the longest `prefill_forward_tokens` (the setting's, or its halves down to
    `prefill_chunk_tokens`) at which the weights, every expert on the GPU, and the engine fit `room`
    (the KV target's and the encoder outputs' floor left out), or the shortest where none does; and
    the engine's take at it. Where this GPU, model and settings were measured, that take, else the
    take at the setting's forward (measured, or FIRST_START_ENGINE_BYTES) less the activations of the
    tokens it no longer graphs."""
    measured = _measured(settings.cache_path)
    base = measured.get(_key(model, settings, device), FIRST_START_ENGINE_BYTES)
    # Every expert on the GPU, the embeddings in host memory (where they go first when memory is short).
    weights = (weights_bytes(model, settings.weights, settings.speech)
               - embeddings_bytes(model, settings.weights, settings.speech))
    per_token = prefill_bytes_per_token(model)
    choice = settings
    for tokens in prefill_forward_choices(settings.prefill_forward_tokens, settings.prefill_chunk_tokens):
        choice = settings.replace(prefill_forward_tokens=tokens)
        # Never planned below half the take: the estimate's saving is a computed peak of activations.
        engine = measured.get(_key(model, choice, device),
                              max(base - (settings.prefill_forward_tokens - tokens) * per_token, base // 2))
        if weights + engine <= room:
            break
    return choice, engine


def prefill_forward_choices(forward_tokens: int, chunk_tokens: int) -> list[int]:
    """`forward_tokens`, then its halves while they stay multiples of `chunk_tokens` (a forward ends
    at a multiple of the chunk), down to `chunk_tokens`."""
    choices = [forward_tokens]
    while choices[-1] > chunk_tokens:
        half = choices[-1] // 2
        choices.append(half if half % chunk_tokens == 0 and half >= chunk_tokens else chunk_tokens)
    return choices


def prefill_bytes_per_token(model: torch.nn.Module) -> int:
    """What the engine's take grows by for each token its longest prefill graph holds: the Thinker's
    activations a prefill token takes at their peak in a MoE layer (computed: its top-k experts'
    weighted output rows in float32, their gate and up projections and their product in the
    activations' dtype, and a few hidden-sized rows, the residual, the norm, the attention's output;
    132 KiB at full size), times PREFILL_POOL_OVER_ACTIVATIONS, what the graphs' pool was measured
    to keep beyond them. 190 KiB at full size: 760 MiB for the 4,096 tokens of the default
    prefill_forward_tokens."""
    config = model.thinker.model.language_model.config
    itemsize = next(model.parameters()).dtype.itemsize
    top_k, hidden = config.num_experts_per_tok, config.hidden_size
    expert_rows = top_k * hidden * 4 + top_k * 3 * config.moe_intermediate_size * itemsize
    return round((expert_rows + 8 * hidden * itemsize) * PREFILL_POOL_OVER_ACTIVATIONS)


def _target_blocks(kv: KVSizes, settings: EngineConfig) -> int:
    """The Thinker's blocks of the KV target, or of `gpu_cache_bytes` if fewer: KV_TARGET_TOKENS, and
    twice as many with fp8 KV, whose tokens (the Talker's too) take about half the bytes."""
    tokens = KV_TARGET_TOKENS * (2 if settings.kv_dtype == "fp8" else 1)
    return min(kv.blocks_for(tokens), settings.gpu_cache_bytes // kv.block_bytes)


def least_conversation_kv_bytes(model: torch.nn.Module, settings: EngineConfig, dtype: torch.dtype) -> int:
    """The Thinker's KV blocks for one conversation of `max_context_tokens` (and the pad block)."""
    return least_kv_bytes(kv_sizes(model, settings).thinker, dtype)


def size(count: int) -> str:
    return f"{count / GiB:.1f} GiB" if count >= GiB else f"{count / (1 << 20):.1f} MiB"


def _bus(count: int) -> str:
    return f"{count / 1e6:,.0f} MB" if count >= 1e6 else f"{count / 1e3:,.1f} kB"


def available_bytes(settings: EngineConfig, device: torch.device) -> int | None:
    if settings.gpu_memory_bytes:
        return settings.gpu_memory_bytes
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free - MARGIN_BYTES


def engine_baseline(device: torch.device) -> int:
    """Before the engine starts: the bytes its allocator reserves already (the weights, and whatever
    else the process holds; what loading them left cached is given back first, so the engine's
    take is never hidden in it), the peak counted from here."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def remember_engine_bytes(plan: MemoryPlan, settings: EngineConfig, device: torch.device, baseline: int,
                          kv_bytes: int) -> None:
    """After the engine's warm-up, every graph captured: its measured take, the memory reserved at
    its peak since `baseline` (engine_baseline), less the KV (`kv_bytes`: the Thinker's and the
    Talker's, which the plan counts with the KV), for the next start's plan. A request served while
    the prefill graphs were captured counts too, its activations and encoder outputs: the next plan
    keeps more for the engine than it needs, never less."""
    if device.type != "cuda":
        return
    # Reserved, not allocated: under a 22 GiB cap on an H100 the start-up's graphs and eager forwards
    # left 700 MiB reserved beyond their tensors (docs/benchmarks/2026-12-08-honest-cap-h100.md).
    engine = torch.cuda.max_memory_reserved(device) - baseline - kv_bytes
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


def _refusal(model: torch.nn.Module, settings: EngineConfig, device: torch.device, available: int, rest: int,
             least_encoder: int, placed: Placement, host_most: int | None) -> str:
    """One line: what the settings need at the least (`placed`: the weights on the GPU, and the
    experts `experts_on_gpu` lets go to host memory), what is short, the GPU's memory or the host's,
    and the changes that would fit."""
    changes = _changes(model, settings, device, available - rest, least_encoder, host_most)
    if placed.device_weights + rest > available:
        advice = (f": try {' or '.join(changes)}" if changes else
                  ": no weights format fits; lower max_context_tokens, or use a larger GPU")
        return (f"the model needs {size(placed.device_weights + rest)} of GPU memory (weights "
                f"{size(placed.device_weights)}{_in_host_memory(placed)}, the engine, {size(least_encoder)} of encoder outputs and one "
                f"conversation's KV {size(rest)}), {size(available)} is free{advice}")
    advice = (f": try {' or '.join(changes)}" if changes else
              ": no weights format fits; use a larger GPU, or more memory")
    return (f"the model fits {size(available)} of GPU memory{_in_host_memory(placed)}, but they take "
            f"{size(placed.host_experts + placed.host_embeddings)} of it, more than the "
            f"{size(host_most)} page-locked weights may take (1/{HOST_SHARE} of this machine's memory){advice}")


def _in_host_memory(placed: Placement) -> str:
    """What `placed` puts in host memory, as the refusal says it ("" for nothing)."""
    host = len(placed.host_layers)
    parts = (["the input embeddings"] if placed.host_embeddings else []) + (
        [f"the experts of {host} of {placed.layers} layers"] if host else [])
    return f" with {' and '.join(parts)} in host memory" if parts else ""


def _changes(model: torch.nn.Module, settings: EngineConfig, device: torch.device, room: int, least_encoder: int,
             host_most: int | None) -> list[str]:
    """The fewest changes of settings with which the weights fit `room` bytes of GPU memory and the
    experts in host memory `host_most`: first the encoder cache off, which keeps the format and speech,
    then fewer experts on the GPU, which keeps them too, then other formats, then speech off."""
    def fits(weights: str, speech: bool, setting: int = settings.experts_on_gpu, room: int = room) -> bool:
        return place_weights(model, weights, speech, setting, room, room).fits(room, host_most)

    formats = [f for f in ("bf16", "fp8", "int4") if f != "fp8" or _fp8_runs(device)]
    speech = [True, False] if settings.speech else [False]
    changes = [_change(settings, f, s) for s in speech for f in formats if fits(f, s)]
    if settings.experts_on_gpu != AUTO and fits(settings.weights, settings.speech, AUTO):
        fitting = place_weights(model, settings.weights, settings.speech, AUTO, room, room)
        changes.insert(0, f"experts_on_gpu = {fitting.experts_on_gpu}")
    if least_encoder and fits(settings.weights, settings.speech, room=room + least_encoder):
        changes.insert(0, "encoder_cache = false")
    return [c for c in changes if c.count(" and ") == min(c.count(" and ") for c in changes)] if changes else []


def _change(settings: EngineConfig, weights: str, speech: bool) -> str:
    return " and ".join([*([f"weights = '{weights}'"] if weights != settings.weights else []),
                         *(["speech = false"] if speech != settings.speech else [])])


def _fp8_runs(device: torch.device) -> bool:
    return device.type != "cuda" or has_fp8_units(device)


def _key(model: torch.nn.Module, settings: EngineConfig, device: torch.device) -> str:
    """A full-length digest of what the engine's take depends on: the GPU, the model's dimensions, and
    the settings that size graphs and activations. ("measured": what the take holds, so that one
    measured while it held the Talker's KV, or in allocated bytes, is not read as this one.)"""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    parts = {"measured": "reserved, without the Talker's KV", "gpu": gpu,
             "config": model.config.to_json_string(use_diff=False),
             "settings": {
        name: getattr(settings, name) for name in (
            "weights", "speech", "dtype", "max_context_tokens", "max_running_requests", "cuda_graphs",
            "compiled_layers", "prefill_chunk_tokens", "prefill_forward_tokens", "kv_block_tokens",
            "gpu_cache_bytes", "moe_backend", "attention_backend", "kv_dtype")}}
    return blake3.blake3(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _measured(cache_dir: Path) -> dict[str, int]:
    try:
        measured = json.loads((cache_dir / "memory.json").read_text(encoding="utf-8"))
        return {k: int(v) for k, v in measured.items()} if isinstance(measured, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}
