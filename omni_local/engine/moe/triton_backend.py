"""The `triton` MoE backend: the router's logits by the router's own weight (one GEMM, as
transformers computes them), then our kernels (routed_experts.py), which read quantized experts
(model/quantized/) in their own formats. The default on CUDA."""

import torch
import torch.nn.functional as F

from omni_local.engine.moe.backend import MoeBackend
from omni_local.engine.moe.block import experts_use_silu, renormalizes
from omni_local.engine.moe.routed_experts import routed_experts
from omni_local.model.quantized import QuantizedExperts


class TritonMoe(MoeBackend):
    """`batch_invariant` (the deterministic setting, engine/batch_invariant.py): the router by our
    GEMV's kernel, one tile config for every token count, and a token's k rows added one after another."""

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        if not experts_use_silu(mlp):
            raise ValueError(f"the triton MoE kernels apply SiLU, and these experts use {mlp.experts.act_fn}")
        if self.batch_invariant:
            logits = torch.ops.omni_local.invariant_matmul(flat, mlp.gate.weight)
        else:
            logits = F.linear(flat, mlp.gate.weight)
        experts = mlp.experts
        pinned = self.batch_invariant
        if isinstance(experts, QuantizedExperts):
            rows = routed_experts(flat, logits, experts.gate_up_values, experts.down_values, mlp.gate.top_k,
                                  renormalizes(mlp), experts.gate_up_scales, experts.down_scales, pinned)
        else:
            rows = routed_experts(flat, logits, experts.gate_up_proj, experts.down_proj, mlp.gate.top_k,
                                  renormalizes(mlp), pinned=pinned)
        if self.batch_invariant:  # a sum's kernel may split k by the token count; adds one by one do not
            return sum(rows.unbind(dim=1)[1:], rows[:, 0]).to(flat.dtype)
        return rows.sum(dim=1).to(flat.dtype)  # the top-k sum, k in order
