"""The `torch` MoE backend: transformers' own router and experts modules, so the result is the model's
own forward bit for bit. The reference the `triton` backend is tested against, and the default off CUDA."""

from contextlib import AbstractContextManager
from typing import Any

import torch

from omni_local.engine.forward.moe.backend import MoeBackend
from omni_local.model.workarounds import capturable_experts, router_past_hooks


class TorchMoe(MoeBackend):
    name = "torch"

    def routed_experts(self, mlp: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
        _, weights, chosen = router_past_hooks(mlp.gate, flat)
        return mlp.experts(flat, chosen, weights)

    def capturable(self, stack_config: Any, dtype: torch.dtype) -> AbstractContextManager[None]:
        return capturable_experts(stack_config, dtype)


TORCH = TorchMoe()
