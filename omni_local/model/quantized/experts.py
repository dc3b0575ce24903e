"""A MoE block's routed experts with quantized weights, in place of transformers' experts module.

It holds what transformers' module holds, `gate_up_proj` [E, 2I, H] (each expert's gate rows, then
its up rows) and `down_proj` [E, H, I], as `Quantized` weights (formats.py): values and scales
buffers, filled whole (`replacing` a loaded module) or one expert's projection at a time: quantized
here (`take_expert_weight`, from the loader, so no full-precision copy of a layer's experts is
made), or as a checkpoint quantized before loading holds it (`take_expert_quantized`). Experts marked
for host memory (model/host_experts.py) allocate them there.

Its `forward` is transformers' eager experts loop with each chosen expert's weights dequantized
first: the reference, and the `torch` MoE backend's path on the CPU. The `triton` backend reads
the quantized weights in its kernels instead (engine/forward/moe/).
"""

import torch
import torch.nn.functional as F

from omni_local.model.host_experts import carry_mark, experts_empty
from omni_local.model.quantized.formats import QuantFormat, Quantized, dequantize, quantize, quantized_bytes

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedExperts(torch.nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: torch.nn.Module,
                 format: QuantFormat) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.act_fn, self.format = act_fn, format
        self.prefilled = False  # filled before loading (read back from disk): the loader hands it nothing
        self.group: int | None = None  # int4's inputs per scale, where known before the weights are (a checkpoint's)
        for name in ("gate_up_values", "gate_up_scales", "down_values", "down_scales"):
            self.register_buffer(name, None)

    @classmethod
    def replacing(cls, experts: torch.nn.Module, format: QuantFormat) -> "QuantizedExperts":
        """Experts for `experts`' place, quantized from its weights one expert at a time, unless they
        are still on the meta device (a skeleton being loaded)."""
        num, double, hidden = experts.gate_up_proj.shape
        layer = cls(num, hidden, double // 2, experts.act_fn, format)
        carry_mark(experts, layer)
        if not experts.gate_up_proj.is_meta:
            for expert in range(num):
                gate, up = experts.gate_up_proj[expert].detach().chunk(2)
                for projection, weight in zip(_PROJECTIONS, (gate, up, experts.down_proj[expert].detach())):
                    layer.take_expert_weight(expert, projection, weight)
        return layer

    @property
    def gate_up(self) -> Quantized:
        return _weight(self.format, self.gate_up_values, self.gate_up_scales)

    @property
    def down(self) -> Quantized:
        return _weight(self.format, self.down_values, self.down_scales)

    @property
    def empty(self) -> bool:
        """Whether it holds no weights yet (swapped into a model not loaded yet)."""
        return self.gate_up_values is None and self.down_values is None

    def planned_bytes(self, dtype: torch.dtype) -> int:
        """The bytes it will hold once loaded, in a model of `dtype`."""
        gate_up = (self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)
        down = (self.num_experts, self.hidden_dim, self.intermediate_dim)
        return sum(quantized_bytes(shape, self.format, dtype, self.group) for shape in (gate_up, down))

    def take_expert_weight(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """One expert's `gate_proj` [I, H], `up_proj` [I, H] or `down_proj` [H, I], quantized into
        its rows. Each row's scales depend on that row alone, so gate and up quantized apart equal
        gate_up quantized whole."""
        self.take_expert_quantized(expert, projection, quantize(tensor, self.format))

    def take_expert_quantized(self, expert: int, projection: str, weight: Quantized) -> None:
        """One expert's projection already quantized in this module's format, written into its rows.
        Every expert of a module has the same int4 group (the first one's allocates the scales)."""
        assert weight.format == self.format, (weight.format, self.format)
        target = "down" if projection == "down_proj" else "gate_up"
        if getattr(self, f"{target}_values") is None:
            self._allocate(target, weight)
        rows = slice(None)
        if projection != "down_proj":
            start = 0 if projection == "gate_proj" else self.intermediate_dim
            rows = slice(start, start + self.intermediate_dim)
        getattr(self, f"{target}_values")[expert, rows] = weight.values
        getattr(self, f"{target}_scales")[expert, rows] = weight.scales

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == expert)
            gate_up = dequantize(_expert(self.gate_up, expert), hidden_states.dtype)
            down = dequantize(_expert(self.down, expert), hidden_states.dtype)
            gate, up = F.linear(hidden_states[token], gate_up).chunk(2, dim=-1)
            rows = F.linear(self.act_fn(gate) * up, down) * top_k_weights[token, k, None]
            out.index_add_(0, token, rows.to(out.dtype))
        return out

    def _allocate(self, target: str, first: Quantized) -> None:
        rows = 2 * self.intermediate_dim if target == "gate_up" else self.hidden_dim
        for part, tensor in (("values", first.values), ("scales", first.scales)):
            shape = (self.num_experts, rows, *tensor.shape[1:])
            setattr(self, f"{target}_{part}", experts_empty(self, shape, tensor.dtype, tensor.device))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"format={self.format}")


def _weight(format: QuantFormat, values: torch.Tensor, scales: torch.Tensor) -> Quantized:
    """int4's group is told by its values [E, N, K/2] and scales [E, N, K/group]."""
    return Quantized(format, values, scales, 2 * values.shape[-1] // scales.shape[-1] if format == "int4" else 0)


def _expert(weight: Quantized, expert: int) -> Quantized:
    return Quantized(weight.format, weight.values[expert], weight.scales[expert], weight.group)
