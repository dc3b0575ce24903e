"""The `triton` MoE backend: the router's logits by the router's own weight (one GEMM, as
transformers computes them), then our kernels (routed_experts.py). The default on CUDA.

Only up to `longest_tokens` at once, the kernels' small-batch and prefill paths. A longer input goes
to transformers' grouped GEMMs (the `torch` backend), which were faster there on the H200: a cold
2,123-token prompt, prefilled in one eager forward, took 103.5 ms with our kernels for every MoE
layer and 65.7 ms with transformers' (README, runs I and H); the tiles are tuned up to 512 tokens.
"""

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from omni_local.engine.moe.backend import MoeBackend
from omni_local.engine.moe.block import experts_use_silu, renormalizes
from omni_local.engine.moe.routed_experts import routed_experts
from omni_local.engine.moe.torch_backend import TORCH


class TritonMoe(MoeBackend):
    name = "triton"
    longest_tokens = 512

    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] > self.longest_tokens:
            return TORCH.routed_experts(mlp, flat)
        if not experts_use_silu(mlp):
            raise ValueError(f"the triton MoE kernels apply SiLU, and these experts use {mlp.experts.act_fn}")
        logits = F.linear(flat, mlp.gate.weight)
        rows = routed_experts(flat, logits, mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.top_k,
                              renormalizes(mlp))
        return rows.sum(dim=1).to(flat.dtype)  # the top-k sum, k in order

    def capturable(self, stack_config: Any, dtype: torch.dtype) -> AbstractContextManager[None]:
        return TORCH.capturable(stack_config, dtype)  # for a graph longer than `longest_tokens`
