"""Tile configs of the expert GEMMs, per (experts, hidden, intermediate, GPU) and token count.

Tuned configs are committed data: each file of tile_configs/, named as
experts128_hidden2048_intermediate768_NVIDIA_H200.json (experts in the activations' dtype) or
..._NVIDIA_H200_int4.json (experts quantized, model/quantized/: a kernel that unpacks nibbles may
want other tiles), written by `python -m omni_local.bench.moe_tuning [--weights int4]`, maps a token
count to a config; a call takes the config of the smallest listed count at or above its own (the
largest listed past them). Quantized experts without a file of their format take the unquantized
file's. Any other shape or GPU, and a forced architecture (OMNI_LOCAL_FORCE_ARCH), takes the
defaults: tiles small enough for the shared memory of every GPU from Ampere on (3 stages of a
64x64x64 gate_up tile are 72 KiB: Ada, Ampere's sm86 and Blackwell's sm120 have 99 KiB a block;
tests/unit/test_kernel_builds.py compiles them for each architecture).
"""

import json
import re
from bisect import bisect_left
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from omni_local.kernels.triton_support import kernel_gpu

TILE_CONFIG_DIR = Path(__file__).resolve().parent / "tile_configs"
# The token counts the tuning script times, most used first: decode batches (up to 16 tokens, the
# small-batch path), then prefill lengths.
TUNED_TOKENS = (1, 16, 4, 8, 2, 128, 512, 32, 64, 256)


@dataclass(frozen=True)
class GemmTile:
    """One expert GEMM's tile: BLOCK_N output columns by BLOCK_K of the reduction per step."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class TileConfig:
    """The sort's BLOCK_M (rows per expert block, which both GEMMs share) and each GEMM's tile.
    A deterministic mode would pin one config for every token count: each pair's sums then run in
    the same order whatever else is in the batch."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "TileConfig":
        return cls(data["block_m"], GemmTile(**data["gate_up"]), GemmTile(**data["down"]))


# Decode batches (up to 16 tokens, at most 128 pairs) fill few rows of an expert's block: 16, the
# smallest tl.dot takes. Prefills fill blocks of 64.
SMALL_BATCH_DEFAULT = TileConfig(16, GemmTile(), GemmTile())
PREFILL_DEFAULT = TileConfig(64, GemmTile(), GemmTile())


def default_config(tokens: int) -> TileConfig:
    return SMALL_BATCH_DEFAULT if tokens <= 16 else PREFILL_DEFAULT


def config_file_name(experts: int, hidden: int, intermediate: int, device_name: str, quantized: str | None = None
                     ) -> str:
    """The file of a shape on a GPU, for experts in the activations' dtype or `quantized` ('fp8', 'int4')."""
    # Letters, digits and underscores only: a GPU's name holds spaces and dashes, and such a file
    # must be safe to name on any system and to pass through any tool.
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return f"experts{experts}_hidden{hidden}_intermediate{intermediate}_{gpu}{f'_{quantized}' if quantized else ''}.json"


def tile_config(experts: int, hidden: int, intermediate: int, tokens: int, device: torch.device,
                quantized: str | None = None) -> TileConfig:
    """The config for `tokens` tokens through experts of this shape on `device`, stored as `quantized`
    ('fp8', 'int4') or None (the activations' dtype)."""
    # Called for every MoE layer of every forward that is not a graph's replay: the lookups are cached.
    gpu = kernel_gpu(device)
    tuned = _tuned_configs(experts, hidden, intermediate, gpu.name, quantized) if gpu and gpu.name else {}
    if not tuned:
        return default_config(tokens)
    counts = list(tuned)  # ascending
    return tuned[counts[min(bisect_left(counts, tokens), len(counts) - 1)]]


@cache
def _tuned_configs(experts: int, hidden: int, intermediate: int, device_name: str, quantized: str | None
                   ) -> dict[int, TileConfig]:
    """The configs of the GPU's file for the format (else for unquantized experts) by token count, in
    ascending order; none where neither file exists."""
    path = TILE_CONFIG_DIR / config_file_name(experts, hidden, intermediate, device_name, quantized)
    if quantized and not path.exists():
        path = TILE_CONFIG_DIR / config_file_name(experts, hidden, intermediate, device_name)
    if not path.exists():
        return {}
    configs = {int(tokens): TileConfig.from_json(data) for tokens, data in json.loads(path.read_text()).items()}
    return dict(sorted(configs.items()))
