"""Routing in one kernel: the router's softmax, its top-k and the renormalisation of the chosen
probabilities, as transformers' Qwen3-Omni router computes them (softmax in float32, top-k, divide
by their sum when `norm_topk_prob`, then the logits' dtype), one program per token."""

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, num_experts, logits_stride,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_E)
    present = offsets < num_experts
    logits = tl.load(logits_ptr + token * logits_stride + offsets, mask=present, other=-float("inf"))
    logits = logits.to(tl.float32)
    exps = tl.where(present, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probabilities = exps / tl.sum(exps, axis=0)
    # Top-k by k rounds of argmax: the best left, the lowest index among equals (as torch.topk on
    # the GPU), then struck out. Probabilities are >= 0, so -1 is below any of them.
    left = tl.where(present, probabilities, -1.0)
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_experts = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        chosen = tl.min(tl.where(left == best, offsets, BLOCK_E), axis=0)
        top_weights = tl.where(slots == k, best, top_weights)
        top_experts = tl.where(slots == k, chosen, top_experts)
        left = tl.where(offsets == chosen, -1.0, left)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)  # slots past TOP_K hold 0
    kept = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, top_weights.to(weights_ptr.dtype.element_ty), mask=kept)
    tl.store(experts_ptr + token * TOP_K + slots, top_experts, mask=kept)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, experts [tokens, top_k] int32) for router
    logits [tokens, experts], best first."""
    tokens, experts = logits.shape
    weights = logits.new_empty((tokens, top_k))
    chosen = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, chosen, experts, logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(experts),
                                 BLOCK_K=triton.next_power_of_2(top_k), num_warps=1)
    return weights, chosen
