"""MoE blocks' parts made to order for the kernel tests: transformers' own experts and router
modules with random weights, and router logits that route each token to the experts named."""

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerTextExperts,
    Qwen3OmniMoeThinkerTextTopKRouter,
)


def text_config(num_experts: int, top_k: int, hidden: int, intermediate: int,
                renormalize: bool = True) -> Qwen3OmniMoeTextConfig:
    return Qwen3OmniMoeTextConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts,
                                  num_experts_per_tok=top_k, norm_topk_prob=renormalize, hidden_act="silu")


def experts(config: Qwen3OmniMoeTextConfig, dtype: torch.dtype, device: str = "cpu",
            seed: int = 0) -> Qwen3OmniMoeThinkerTextExperts:
    """transformers' experts module, weights drawn as the model's initialiser draws them."""
    module = Qwen3OmniMoeThinkerTextExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (module.gate_up_proj, module.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    return module.to(device, dtype)


def router_over_logits(config: Qwen3OmniMoeTextConfig) -> Qwen3OmniMoeThinkerTextTopKRouter:
    """transformers' router with an identity weight: it routes rows of logits given to it as its input."""
    routing = Qwen3OmniMoeTextConfig(**{**config.to_dict(), "hidden_size": config.num_experts})
    router = Qwen3OmniMoeThinkerTextTopKRouter(routing)
    with torch.no_grad():
        router.weight.copy_(torch.eye(config.num_experts))
    return router


def logits_choosing(choices: list[list[int]], num_experts: int, seed: int = 0) -> torch.Tensor:
    """Logits [tokens, experts] float32 whose top-k for token t are `choices[t]`, best first, each
    weight a different size; every other expert well below."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.rand((len(choices), num_experts), generator=generator) * 2 - 4
    for token, chosen in enumerate(choices):
        for rank, expert in enumerate(chosen):
            logits[token, expert] = 2.0 - 0.7 * rank + 0.1 * torch.rand((), generator=generator)
    return logits


# Routings that the expert kernels' tests take each kernel through, by what they exercise.
ROUTES = {
    "an expert gets no token": [[0, 1], [1, 0], [2, 1], [0, 2]],  # expert 3 of 4 idle
    "one token routed to its top-k": [[3, 1]],
    "uneven loads, one expert over a block": [[1, 0]] * 18 + [[2, 3], [3, 1]],
}
