"""The tile of `quantized_gemv` (gemv.py), per weight shape [N, K].

A deterministic mode needs a row's sums to run in the same order whatever the batch: the tile is
chosen from the weight's shape alone, never from the row count, and BLOCK_M is fixed with it (one
kernel, the same per-program code, for every decode batch; more rows take more programs).
"""

from dataclasses import dataclass

import torch

from omni_local.kernels.triton_support import kernel_gpu


@dataclass(frozen=True)
class GemvTile:
    """Each program: BLOCK_M rows by BLOCK_N outputs, over its share of K in steps of BLOCK_K.
    SPLIT_K > 1 splits K into that many runs of whole BLOCK_K steps, one program each, their float32
    sums added in split order by the last to finish: more programs for a weight of few output tiles."""

    block_m: int = 16  # the smallest tl.dot takes: a decode batch of up to 16 rows is one block
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# For every architecture, and GPUs and shapes not tuned below (python -m omni_local.bench.dense_projections --sweep). Its loads
# pipelined over 4 stages take 24 KiB of shared memory for bfloat16 rows, 52 KiB for float32 (compiled
# for sm_90: tests/kernels/test_quantized_gemv.py), inside the 99 KiB a block of Ada, Ampere's sm86 and
# Blackwell's sm120 may take. BLOCK_N 32 gives the Thinker's q_proj (N 4,096) 128 programs, about one
# per SM of an H200; its k/v_proj (N 512) only 16, where SPLIT_K may pay for its partial sums' traffic.
DEFAULT = GemvTile()

# Tuned tiles by (GPU name, N, K). A tile tuned on one GPU may not fit another's shared memory, so
# each GPU has its own, and a forced architecture (OMNI_LOCAL_FORCE_ARCH) takes DEFAULT. The H200's: `python -m omni_local.bench.dense_projections --sweep --runs 30`
# (torch 2.11, Triton 3.6; the best sum over 1 and 16 rows, fp8 and int8) for the Thinker's q_proj
# and k_proj before q, k and v were fused (2026-12-02), and for the fused qkv_proj (N 5,120) and
# o_proj once a split's sums cost no launch of their own (docs/benchmarks/2026-12-04-queries-normed-by-attention.md).
TUNED: dict[tuple[str, int, int], GemvTile] = {
    ("NVIDIA H200", 4096, 2048): GemvTile(block_n=32, block_k=256, split_k=1, num_stages=4),
    ("NVIDIA H200", 5120, 2048): GemvTile(block_n=32, block_k=128, split_k=4, num_stages=3),
    ("NVIDIA H200", 512, 2048): GemvTile(block_n=32, block_k=256, split_k=8, num_stages=3),
    ("NVIDIA H200", 2048, 4096): GemvTile(block_n=32, block_k=128, split_k=8, num_stages=3),
    # The routers' gates (bfloat16, N 128). The Thinker's swept (`--sweep --shapes router`, 2026-12-04:
    # 6.61 us at one row); the Talker's chosen for 32 programs, not swept (7.15 us at one row, against
    # 7.31 for F.linear, in the run of docs/benchmarks/2026-12-04-split-reductions-one-launch.md).
    ("NVIDIA H200", 128, 2048): GemvTile(block_n=16, block_k=256, split_k=8, num_stages=4),
    ("NVIDIA H200", 128, 1024): GemvTile(block_n=16, block_k=128, split_k=4, num_stages=3),
}


def gemv_tile(out_features: int, in_features: int, device: torch.device) -> GemvTile:
    gpu = kernel_gpu(device)
    return TUNED.get((gpu.name, out_features, in_features), DEFAULT) if gpu else DEFAULT
