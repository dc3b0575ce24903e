"""The routed experts of one MoE block by our kernels: route, sort (one launch for both at a decode
batch), gate_up, down, and the top-k sum.

`routed_experts` is registered as the torch op `omni_local::routed_experts`, so torch.compile
leaves it whole inside the compiled decoder layers (the kernels pick their tile config from the
token count at run time) and a CUDA graph captures its launches.

The top-k sum: the down kernel writes each (token, k) pair's weighted row apart, in float32, and
the backend adds a token's k rows in one fixed order (engine/forward/moe/triton_backend.py, top_k_sum).
Atomic adds into one row would need a zeroed float32 buffer and a cast pass anyway, and their order
changes from run to run; this order does not depend on the token count, the batch or the tile
config, which a deterministic mode needs.
It costs a [tokens, top_k, hidden] float32 round trip (64 KiB a layer for one token at full size;
32 MiB for a 512-token prefill, against 1.2 GB of expert weights read), and in the compiled layers
the sum fuses into the residual add that follows.

Triton compiles a kernel for each set of its constants and, unless told otherwise, for whether each
integer argument is 1 or a multiple of 16: a token count it had not met compiled the kernels anew
in someone's turn (the Talker's prefill runs eagerly, at any length: on an H200, a fresh process's
second app spoke its first voice reply 1,464 ms after the question, 127 ms with what follows). The
kernels take their token and pair counts unspecialised, so what they compile is their plan
(`kernel_plan`: the kernels and the tiles), and `first_count_of_each_plan` lets start-up compile
every plan a stack can meet.
"""

from dataclasses import dataclass

import torch

from omni_local.kernels.moe.down import weighted_down
from omni_local.kernels.moe.gate_up import gate_up_silu
from omni_local.kernels.moe.pairs import gate_up_silu_by_pair, weighted_down_by_pair
from omni_local.kernels.moe.route_and_sort import fits_one_program, route_and_sort
from omni_local.kernels.moe.routing import route
from omni_local.kernels.moe.sorting import sort_by_expert, sorts_in_chunks
from omni_local.kernels.moe.expert_weights import KernelWeight, kernel_weight
from omni_local.kernels.moe.tile_configs import TileConfig, tile_config

# Up to this many tokens, quantized (int4, fp8) experts run by pair (pairs.py), each pair's
# expert rows read as a GEMV reads them; more tokens share experts, which the sorted blocks read once
# for all of them.
PAIR_KERNEL_TOKENS = 4


@dataclass(frozen=True)
class KernelPlan:
    """Which kernels run a forward's experts, with which tiles: what Triton compiles kernels for."""

    by_pair: bool  # quantized experts at a few tokens: pairs.py, no sort
    config: TileConfig | None  # the sorted blocks' tiles (None by pair)
    one_program: bool  # routing and sort in one launch (a decode batch)
    chunked_sort: bool  # the sort in three launches over chunks of pairs


def kernel_plan(tokens: int, top_k: int, gate_up: KernelWeight, down: KernelWeight, device: torch.device,
                config: TileConfig | None = None, pinned: bool = False) -> KernelPlan:
    """The plan for `tokens` tokens (see `weighted_expert_rows`)."""
    if config is None and not pinned and tokens <= PAIR_KERNEL_TOKENS and gate_up.quantized is not None:
        return KernelPlan(by_pair=True, config=None, one_program=False, chunked_sort=False)
    config = config or tile_config(gate_up.values.shape[0], gate_up.in_features, down.in_features,
                                   1 if pinned else tokens, device, gate_up.quantized)
    one_program = fits_one_program(tokens)
    return KernelPlan(False, config, one_program, not one_program and sorts_in_chunks(tokens * top_k))


def first_count_of_each_plan(most_tokens: int, top_k: int, gate_up: KernelWeight, down: KernelWeight,
                             device: torch.device, pinned: bool = False) -> list[int]:
    """The smallest token count of each plan that 1 to `most_tokens` tokens take, ascending."""
    plans = {}
    for tokens in range(1, most_tokens + 1):
        plans.setdefault(kernel_plan(tokens, top_k, gate_up, down, device, pinned=pinned), tokens)
    return sorted(plans.values())


def weighted_expert_rows(hidden: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         top_k: int, renormalize: bool, config: TileConfig | None = None,
                         gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None,
                         pinned: bool = False) -> torch.Tensor:
    """Each token's top-k experts' outputs, scaled by their routing weights: [tokens, top_k, hidden]
    float32, for `hidden` [tokens, hidden], router `logits` [tokens, E], and the experts' contiguous
    `gate_up` [E, 2I, hidden] and `down` [E, hidden, I] (each in the hidden dtype, or quantized
    values with their scales: model/quantized/formats.py); `config` None takes the tuned one for the
    token count (quantized experts at up to PAIR_KERNEL_TOKENS tokens: the kernels by pair), or `pinned`,
    a decode step's for any count (each pair's sums then run in one order whatever the batch: the
    deterministic setting)."""
    gate_up_weight, down_weight = kernel_weight(gate_up, gate_up_scales), kernel_weight(down, down_scales)
    tokens, width = hidden.shape
    if tokens == 0:
        return hidden.new_zeros((0, top_k, width), dtype=torch.float32)
    logits = logits.contiguous()
    plan = kernel_plan(tokens, top_k, gate_up_weight, down_weight, hidden.device, config, pinned)
    if plan.by_pair:
        weights, experts = route(logits, top_k, renormalize)
        activated = gate_up_silu_by_pair(hidden.contiguous(), gate_up_weight, experts)
        return weighted_down_by_pair(activated, down_weight, experts, weights).view(tokens, top_k, width)
    block_m = plan.config.block_m
    if plan.one_program:  # a decode batch: one launch
        weights, experts, order = route_and_sort(logits, top_k, renormalize, block_m)
    else:
        weights, experts = route(logits, top_k, renormalize)
        order = sort_by_expert(experts, gate_up.shape[0], block_m)
    activated = gate_up_silu(hidden.contiguous(), gate_up_weight, order, experts, block_m, plan.config.gate_up)
    rows = weighted_down(activated, down_weight, order, experts, weights, block_m, plan.config.down)
    return rows.view(tokens, top_k, width)


@torch.library.custom_op("omni_local::routed_experts", mutates_args=())
def routed_experts(hidden: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   top_k: int, renormalize: bool, gate_up_scales: torch.Tensor | None = None,
                   down_scales: torch.Tensor | None = None, pinned: bool = False) -> torch.Tensor:
    """`weighted_expert_rows` with the tuned config (`pinned`: a decode step's), as one op."""
    return weighted_expert_rows(hidden, logits, gate_up, down, top_k, renormalize, None, gate_up_scales, down_scales,
                                pinned)


@routed_experts.register_fake
def _(hidden: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
      top_k: int, renormalize: bool, gate_up_scales: torch.Tensor | None = None,
      down_scales: torch.Tensor | None = None, pinned: bool = False) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], top_k, hidden.shape[1]), dtype=torch.float32)
