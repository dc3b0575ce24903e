"""The `deterministic` setting: every kernel on the Thinker's and the Talker's path gives a token's row
the same bits whatever else is in its forward, so a cached prefix, a batch of other chats or a
restart never changes a greedy answer.

Without it, the same token's row is computed by kernels chosen by how many tokens a forward holds
(cuBLAS picks its GEMM, its tile and its split-K by the row count; torch and inductor split a norm's
row across threads when rows are few; attention walks a prefill's rows in other tiles than a decode
step's), so a row recomputed in a long prefill, written by a decode step, or computed in a tail on a
cached prefix rounds differently; on random weights, near-ties make greedy replies diverge.

With it, the engine runs:
- dense layers (every Linear of the Thinker's text stack and lm_head, and of the Talker's modules;
  the MoE routers): our GEMV's kernel for every row count, its tile fixed by the weight's shape
  (`omni_local::invariant_matmul`, kernels/gemv.py); quantized layers its quantized form;
- RMSNorms: one program a row (kernels/rms_norm.py);
- attention: our paged kernel with one query tile for every length and a tail's rows split and
  merged as a decode step's (kernels/attention/paged.py, `batch_invariant`), for prefills too;
- MoE experts: our kernels with the decode batch's tile config for every token count, and the top-k
  rows added in k order (engine/forward/moe/, `TritonMoe(batch_invariant=True)`).
The rest is row by row already (embeddings, rotary embedding, residual adds, routing's softmax and
top-k, the sampler's argmax). It needs our Triton kernels: a CUDA GPU, or Triton's interpreter.
"""

from functools import cache

import torch

from omni_local.engine.forward.fused_qkv import fuse_qkv
from omni_local.model.quantized import QuantizedLinear


class InvariantLinear(torch.nn.Linear):
    """A Linear multiplied by `omni_local::invariant_matmul` (its class swapped in by `make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.omni_local.invariant_matmul(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class InvariantRMSNorm(torch.nn.Module):
    """A transformers RMSNorm (`weight`, `variance_epsilon`) normed by `omni_local::rms_norm`."""

    weight: torch.nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.ops.omni_local.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def make_batch_invariant(model: torch.nn.Module, speech: bool) -> None:
    """Make the Thinker's text stack and lm_head, and with `speech` the Talker (its stack, code
    predictor, projections and heads), compute each token's row alone: their Linears and RMSNorms
    swapped for the invariant ones (the same parameters), their quantized layers told to. The
    encoders and Code2Wav keep theirs: they compute one medium, or one reply's codes, the same way
    every time. q, k and v are fused first (fuse_qkv), so the fused projection is the one swapped.
    A model made so stays so (apps sharing it, as the bench's, all compute rows alone)."""
    import omni_local.kernels.gemv  # registers omni_local::invariant_matmul (imports Triton)
    import omni_local.kernels.rms_norm  # noqa: F401 (registers omni_local::rms_norm)

    thinker = model.thinker
    parts = [thinker.model.language_model, thinker.lm_head]
    fuse_qkv(thinker.model.language_model)
    if speech:
        talker = model.talker
        fuse_qkv(talker.model)
        fuse_qkv(talker.code_predictor.model)
        parts.append(talker)
    for part in parts:
        for module in part.modules():
            _swap(module)


def _swap(module: torch.nn.Module) -> None:
    if type(module) is torch.nn.Linear:
        module.__class__ = InvariantLinear
    elif isinstance(module, QuantizedLinear):
        module.make_batch_invariant()
    elif (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
          and not isinstance(module, InvariantRMSNorm)):
        module.__class__ = _invariant_norm(type(module))


@cache
def _invariant_norm(norm: type) -> type:
    """`norm` (a transformers RMSNorm class) with InvariantRMSNorm's forward: one class each, so
    the compiled layers meet one type per norm, as before."""
    return type(f"Invariant{norm.__name__}", (InvariantRMSNorm, norm), {})
