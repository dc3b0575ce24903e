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
    GEMV's kernel and one tile config for every token count."""

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
        return top_k_sum(rows).to(flat.dtype)


def top_k_sum(rows: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden]: each token's k rows of `rows` [tokens, top_k, hidden] added one after another,
    in k order. Not `rows.sum(dim=1)`: compiled, that is a reduction over the strided k axis, 381 us a
    layer for a 2,123-token prefill on an H200 (more than the experts' GEMMs), where k adds are one
    elementwise kernel reading along hidden; and a sum's kernel may split k by the token count, which
    the deterministic setting forbids. Adds one by one have one order whatever the batch."""
    return sum(rows.unbind(dim=1)[1:], rows[:, 0])
