"""The MoE forward of every decoder layer (the Thinker's and the Talker's): router, routed experts,
and the Talker's shared expert, the routed experts run by a backend behind `MoeBackend`.

- `torch` (torch_backend.py): transformers' own router and experts modules, bit for bit; the
  reference.
"""

from omni_local.engine.moe.backend import MoeBackend, mlp_output
from omni_local.engine.moe.torch_backend import TORCH

__all__ = ["TORCH", "MoeBackend", "mlp_output"]
