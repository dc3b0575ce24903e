"""Routing: the router's softmax, its top-k and the renormalisation of the chosen probabilities, as
transformers' Qwen3-Omni router computes them (softmax in float32, top-k, divide by their sum when
`norm_topk_prob`, then the logits' dtype), for a tile of TOKENS_PER_PROGRAM tokens a program.

`route_tokens` is the tile's work, shared with route_and_sort.py (a decode batch's routing and sort
in one launch): both run the same tile shape, so a token's weights are the same bits either way.
"""

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 16  # a decode batch's tokens (up to 16 chats) in one tile


@triton.jit
def route_tokens(logits_ptr, weights_ptr, experts_ptr, first, tokens, num_experts, logits_stride,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Tokens [first, first + BLOCK_T) (those below `tokens`): each one's top-k weights and experts,
    best first, stored at its row of `weights_ptr` and `experts_ptr` [tokens, TOP_K]."""
    token = first + tl.arange(0, BLOCK_T)
    real = token < tokens
    offsets = tl.arange(0, BLOCK_E)
    present = offsets < num_experts
    at = token.to(tl.int64)[:, None] * logits_stride + offsets[None, :]
    logits = tl.load(logits_ptr + at, mask=real[:, None] & present[None, :], other=-float("inf")).to(tl.float32)
    # A padding token's row is all -inf: its max and sums are replaced, so it computes numbers, never stored.
    row_max = tl.max(logits, axis=1)
    row_max = tl.where(real, row_max, 0.0)
    exps = tl.where(present[None, :], tl.exp(logits - row_max[:, None]), 0.0)
    sums = tl.sum(exps, axis=1)
    probabilities = exps / tl.where(real, sums, 1.0)[:, None]
    # Top-k by k rounds of argmax: the best left, the lowest index among equals (as torch.topk on
    # the GPU), then struck out. Probabilities are >= 0, so -1 is below any of them.
    left = tl.where(present[None, :], probabilities, -1.0)
    slots = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_experts = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=1)
        chosen = tl.min(tl.where(left == best[:, None], offsets[None, :], BLOCK_E), axis=1)
        top_weights = tl.where(slots[None, :] == k, best[:, None], top_weights)
        top_experts = tl.where(slots[None, :] == k, chosen[:, None], top_experts)
        left = tl.where(offsets[None, :] == chosen[:, None], -1.0, left)
    if RENORMALIZE:
        top_weights = top_weights / tl.where(real, tl.sum(top_weights, axis=1), 1.0)[:, None]  # past TOP_K: 0
    kept = real[:, None] & (slots[None, :] < TOP_K)
    out = token[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out, top_weights.to(weights_ptr.dtype.element_ty), mask=kept)
    tl.store(experts_ptr + out, top_experts, mask=kept)


@triton.jit(do_not_specialize=["tokens"])
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, tokens, num_experts, logits_stride, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    route_tokens(logits_ptr, weights_ptr, experts_ptr, tl.program_id(0) * BLOCK_T, tokens, num_experts,
                 logits_stride, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)


def routing_outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights [tokens, top_k] in the logits' dtype, experts [tokens, top_k] int32)."""
    tokens = logits.shape[0]
    return logits.new_empty((tokens, top_k)), torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)


def routing_blocks(logits: torch.Tensor, top_k: int) -> dict[str, int]:
    """The tile sizes `route_tokens` takes for these logits."""
    return dict(BLOCK_T=TOKENS_PER_PROGRAM, BLOCK_E=triton.next_power_of_2(logits.shape[1]),
                BLOCK_K=triton.next_power_of_2(top_k))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, experts [tokens, top_k] int32) for router
    logits [tokens, experts], best first."""
    tokens, experts = logits.shape
    weights, chosen = routing_outputs(logits, top_k)
    if tokens:
        _route_kernel[(triton.cdiv(tokens, TOKENS_PER_PROGRAM),)](
            logits, weights, chosen, tokens, experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
            **routing_blocks(logits, top_k), num_warps=4)
    return weights, chosen
