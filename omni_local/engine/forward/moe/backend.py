"""The interface every MoE backend has, and a decoder layer's MLP output through one."""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from omni_local.engine.forward.moe.block import is_sparse_moe, shared_expert_output


class MoeBackend(ABC):
    """How a MoE block's routed experts run. The shared expert, and dense MLPs, are the same in
    every backend (`mlp_output`)."""

    name: str

    @abstractmethod
    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [tokens, hidden] of MoE block `mlp` for `flat` [tokens, hidden]:
        the router's top-k experts of each token, weighted and summed."""

    def warm_up(self, mlp: torch.nn.Module, most_tokens: int) -> None:
        """Runs MoE block `mlp`'s experts once for each kernel (or tile) it will take for 1 to
        `most_tokens` tokens, so none is compiled in someone's turn."""

    def capturable(self, stack_config: Any, dtype: torch.dtype) -> AbstractContextManager[None]:
        """A context in which the experts of a decoder stack with this config, in `dtype`, can be
        captured in a CUDA graph."""
        return nullcontext()


def mlp_output(mlp: torch.nn.Module, hidden: torch.Tensor, moe: MoeBackend) -> torch.Tensor:
    """`mlp(hidden)` for any decoder layer's MLP, a MoE block's routed experts run by `moe`."""
    if not is_sparse_moe(mlp):
        return mlp(hidden)
    flat = hidden.view(-1, hidden.shape[-1])
    output = moe.routed_experts(mlp, flat)
    shared = shared_expert_output(mlp, flat)
    if shared is not None:
        output = output + shared
    return output.reshape(hidden.shape)
