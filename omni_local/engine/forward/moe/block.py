"""What a MoE block of transformers' Qwen3-Omni is made of, read off its modules: the router (`gate`),
the routed experts (3-D `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), and, in the Talker,
a shared expert that every token goes through, gated by a sigmoid."""

import torch
from transformers.activations import SiLUActivation


def is_sparse_moe(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a routed MoE block (the code predictor's, and `mlp_only_layers`, are dense)."""
    return isinstance(getattr(mlp, "gate", None), torch.nn.Module) and hasattr(mlp, "experts")


def renormalizes(mlp: torch.nn.Module) -> bool:
    """Whether the router scales its top-k probabilities to sum to one (`norm_topk_prob`; routers
    without the flag always do)."""
    return bool(getattr(mlp.gate, "norm_topk_prob", True))


def experts_use_silu(mlp: torch.nn.Module) -> bool:
    """Whether the routed experts' activation is SiLU (Qwen3-Omni's `hidden_act`), the one our kernels apply."""
    return isinstance(mlp.experts.act_fn, (SiLUActivation, torch.nn.SiLU))


def shared_expert_output(mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor | None:
    """The gated shared expert's output [tokens, hidden] for `flat` [tokens, hidden], or None for a
    block without one (the Thinker's)."""
    if not hasattr(mlp, "shared_expert"):
        return None
    return torch.sigmoid(mlp.shared_expert_gate(flat)) * mlp.shared_expert(flat)
