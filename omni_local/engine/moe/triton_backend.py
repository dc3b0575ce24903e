"""The `triton` MoE backend: the router's logits by the router's own weight (one GEMM, as
transformers computes them), then our kernels (routed_experts.py). The default on CUDA."""

import torch
import torch.nn.functional as F

from omni_local.engine.moe.backend import MoeBackend
from omni_local.engine.moe.block import experts_use_silu, renormalizes
from omni_local.engine.moe.routed_experts import routed_experts


class TritonMoe(MoeBackend):
    name = "triton"

    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        if not experts_use_silu(mlp):
            raise ValueError(f"the triton MoE kernels apply SiLU, and these experts use {mlp.experts.act_fn}")
        logits = F.linear(flat, mlp.gate.weight)
        rows = routed_experts(flat, logits, mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.top_k,
                              renormalizes(mlp))
        return rows.sum(dim=1).to(flat.dtype)  # the top-k sum, k in order
