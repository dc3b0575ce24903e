"""Where each tensor of a Qwen3-Omni checkpoint goes in transformers 5's modules.

Qwen's checkpoints (and transformers 5's `save_pretrained`, which writes that layout back) keep the
Thinker's towers and text model side by side, and each routed expert as three matrices:

    thinker.visual.*, thinker.audio_tower.*, thinker.model.layers.*
    ...mlp.experts.{i}.gate_proj.weight [I, H], up_proj [I, H], down_proj [H, I]

transformers 5 nests them under `thinker.model` and fuses each layer's experts into two parameters:

    thinker.model.visual.*, thinker.model.audio_tower.*, thinker.model.language_model.layers.*
    ...mlp.experts.gate_up_proj [E, 2I, H]  (expert i's gate in rows [0, I), its up in [I, 2I))
    ...mlp.experts.down_proj [E, H, I]

These are the renames and fusions transformers' conversion mapping (`conversion_mapping.py`: the
Thinker's prefix changes for "qwen3_omni_moe", the experts of "qwen2_moe") applies to this model;
its "legacy" renames (LayerNorm.gamma, weight_g, ...) match no name this model has. The Talker and
Code2Wav keep their names; the Talker's routed experts are fused alike, its shared expert is not.
"""

import re
from dataclasses import dataclass

import torch

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The parts only speech needs: without it the model has no Talker and no Code2Wav.
SPEECH_PARTS = ("talker.", "code2wav.")

# Applied in order, as transformers does; each leaves a name already in the new layout as it is.
_RENAMES = (
    (re.compile(r"^thinker\.audio_tower\."), "thinker.model.audio_tower."),
    (re.compile(r"^thinker\.visual\."), "thinker.model.visual."),
    (re.compile(r"^thinker\.model\.(?!language_model\.|visual\.|audio_tower\.)"), "thinker.model.language_model."),
)
_EXPERT = re.compile(
    rf"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>{'|'.join(PROJECTIONS)})\.weight$"
)


@dataclass(frozen=True)
class ExpertSlice:
    """One routed expert's matrix: `module` is the experts module's path."""

    module: str
    expert: int
    projection: str  # one of PROJECTIONS


def model_name(checkpoint_name: str) -> str:
    """The name of a checkpoint tensor in transformers 5's module tree (an expert's stays per expert:
    see `expert_slice`)."""
    for pattern, replacement in _RENAMES:
        checkpoint_name = pattern.sub(replacement, checkpoint_name)
    return checkpoint_name


def expert_slice(name: str) -> ExpertSlice | None:
    """The routed expert matrix a (renamed) name holds, or None for any other tensor."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    return ExpertSlice(match["module"], int(match["expert"]), match["projection"])


def per_expert(name: str, shape: torch.Size) -> dict[str, torch.Size] | None:
    """The per-expert checkpoint names, with their shapes, that make up the fused experts parameter
    `name` of `shape`; None for any other parameter."""
    module, _, fused = name.rpartition(".")
    if not module.endswith(".mlp.experts") or fused not in ("gate_up_proj", "down_proj"):
        return None
    experts, rows, columns = shape
    if fused == "gate_up_proj":
        matrix = torch.Size([rows // 2, columns])
        projections = ("gate_proj", "up_proj")
    else:
        matrix = torch.Size([rows, columns])
        projections = ("down_proj",)
    return {f"{module}.{i}.{projection}.weight": matrix for i in range(experts) for projection in projections}


def fused_rows(projection: str, intermediate: int) -> tuple[str, slice]:
    """The fused parameter an expert's `projection` is part of, and its rows in that expert's slice."""
    if projection == "gate_proj":
        return "gate_up_proj", slice(0, intermediate)
    if projection == "up_proj":
        return "gate_up_proj", slice(intermediate, 2 * intermediate)
    return "down_proj", slice(None)
