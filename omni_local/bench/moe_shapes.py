"""Qwen3-Omni-30B-A3B's MoE blocks at full size (../shared/model-configs/qwen3-omni-30b-a3b-instruct.json),
for the MoE benchmark and the tile tuning: the shapes, and transformers' own block with random weights."""

from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)


@dataclass(frozen=True)
class MoeShape:
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    shared_intermediate: int = 0  # the Talker's shared expert


SHAPES = {
    "thinker": MoeShape(experts=128, hidden=2048, intermediate=768, top_k=8),
    "talker": MoeShape(experts=128, hidden=1024, intermediate=384, top_k=6, shared_intermediate=768),
}


def moe_block(shape: MoeShape, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> torch.nn.Module:
    """transformers' MoE block of `shape` (the Talker's with its shared expert), random weights
    (timings do not depend on their values)."""
    fields = dict(hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate, num_experts=shape.experts,
                  num_experts_per_tok=shape.top_k, norm_topk_prob=True, hidden_act="silu")
    if shape.shared_intermediate:
        config = Qwen3OmniMoeTalkerTextConfig(**fields, shared_expert_intermediate_size=shape.shared_intermediate)
        block_class = Qwen3OmniMoeTalkerTextSparseMoeBlock
    else:
        config = Qwen3OmniMoeTextConfig(**fields)
        block_class = Qwen3OmniMoeThinkerTextSparseMoeBlock
    config._experts_implementation = "grouped_mm"  # as a loaded model's
    with torch.device(device):
        block = block_class(config).to(dtype)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.02)
    return block.eval()
