"""The `triton` MoE backend: the router's logits by the router's own weight (as transformers
computes them: one GEMM; for a decode batch on a GPU, our GEMV), then our kernels
(kernels/moe/routed_experts.py), which read quantized experts (model/quantized/) in their own
formats. The default on CUDA."""

import torch
import torch.nn.functional as F

from omni_local.kernels.gemv import invariant_matmul
from omni_local.engine.forward.moe.backend import MoeBackend
from omni_local.engine.forward.moe.block import experts_use_silu, renormalizes
from omni_local.kernels.moe.expert_weights import kernel_weight
from omni_local.kernels.moe.routed_experts import first_count_of_each_plan, routed_experts
from omni_local.model.quantized import QuantizedExperts
from omni_local.model.quantized.linear import GEMV_MAX_ROWS


class TritonMoe(MoeBackend):
    """`batch_invariant` (the deterministic setting, engine/forward/batch_invariant.py): the router by our
    GEMV's kernel and one tile config for every token count."""

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        if not experts_use_silu(mlp):
            raise ValueError(f"the triton MoE kernels apply SiLU, and these experts use {mlp.experts.act_fn}")
        if self.batch_invariant or (flat.is_cuda and flat.shape[0] <= GEMV_MAX_ROWS):
            # A decode batch's logits: cuBLAS's GEMM took 5 µs a layer on an H200 for the Thinker's
            # router (N 128, K 2,048), 0.24 of int4's 2.69 ms of kernels a step; the GEMV splits K
            # among programs.
            logits = invariant_matmul(flat, mlp.gate.weight)
        else:
            logits = F.linear(flat, mlp.gate.weight)
        gate_up, down, gate_up_scales, down_scales = _expert_weights(mlp.experts)
        rows = routed_experts(flat, logits, gate_up, down, mlp.gate.top_k, renormalizes(mlp), gate_up_scales,
                              down_scales, pinned=self.batch_invariant)
        return top_k_sum(rows).to(flat.dtype)

    @torch.inference_mode()
    def warm_up(self, mlp: torch.nn.Module, most_tokens: int) -> None:
        gate_up, down, gate_up_scales, down_scales = _expert_weights(mlp.experts)
        if not compiles_kernels(gate_up.device):
            return  # Triton's interpreter runs the kernels' Python: nothing to compile, only time to spend
        weights = kernel_weight(gate_up, gate_up_scales), kernel_weight(down, down_scales)
        counts = first_count_of_each_plan(most_tokens, mlp.gate.top_k, *weights, gate_up.device,
                                          pinned=self.batch_invariant)
        hidden = torch.zeros((counts[-1], mlp.gate.weight.shape[1]), dtype=mlp.gate.weight.dtype,
                             device=gate_up.device)
        for tokens in counts:
            self.routed_experts(mlp, hidden[:tokens])


def compiles_kernels(device: torch.device) -> bool:
    """Whether Triton compiles the kernels on `device` (off CUDA, its interpreter runs them)."""
    return device.type == "cuda"


def _expert_weights(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                       torch.Tensor | None]:
    """The experts' gate_up and down weights as the kernels read them, and their scales (None unquantized)."""
    if isinstance(experts, QuantizedExperts):
        return experts.gate_up_values, experts.down_values, experts.gate_up_scales, experts.down_scales
    return experts.gate_up_proj, experts.down_proj, None, None

def top_k_sum(rows: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden]: each token's k rows of `rows` [tokens, top_k, hidden] added one after another,
    in k order. Not `rows.sum(dim=1)`: compiled, that is a reduction over the strided k axis, 381 us a
    layer for a 2,123-token prefill on an H200 (more than the experts' GEMMs), where k adds are one
    elementwise kernel reading along hidden; and a sum's kernel may split k by the token count, which
    the deterministic setting forbids. Adds one by one have one order whatever the batch."""
    return sum(rows.unbind(dim=1)[1:], rows[:, 0])
