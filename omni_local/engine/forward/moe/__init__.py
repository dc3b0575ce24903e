"""The MoE forward of every decoder layer (the Thinker's and the Talker's): router, routed experts,
and the Talker's shared expert, the routed experts run by a backend behind `MoeBackend`.

- `torch` (torch_backend.py): transformers' own router and experts modules, bit for bit; the
  reference, and the default off CUDA.
- `triton` (triton_backend.py): our kernels (kernels/moe/, put together in its routed_experts.py)
  with tile configs per shape and GPU (its tile_configs.py); the default on CUDA.

`moe_backend` (choice.py) makes the `moe_backend` setting a backend for the model's device.
"""

from omni_local.engine.forward.moe.backend import MoeBackend, mlp_output
from omni_local.engine.forward.moe.choice import moe_backend
from omni_local.engine.forward.moe.torch_backend import TORCH

__all__ = ["TORCH", "MoeBackend", "mlp_output", "moe_backend"]
