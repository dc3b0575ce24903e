"""A token embedding whose table is quantized (formats.py), in place of a `torch.nn.Embedding`.

The table [V, H] is held as a weight of V rows of H inputs in a format with one scale a row (int8,
fp8): a lookup gathers the ids' rows of values and scales and dequantizes only those, into the
model's dtype, the dtype the full-precision table gave.
"""

import torch

from omni_local.model.host_experts import carry_mark, placed
from omni_local.model.quantized.formats import QuantFormat, Quantized, dequantize, quantize, quantized_bytes


class QuantizedEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, format: QuantFormat) -> None:
        super().__init__()
        assert format != "int4", "a table's rows are scaled whole"
        self.num_embeddings, self.embedding_dim, self.format = num_embeddings, embedding_dim, format
        self.register_buffer("values", None)
        self.register_buffer("scales", None)
        self.dtype: torch.dtype | None = None  # the rows' dtype out: the model's (`hold` sets it)
        self.prefilled = False  # filled before loading (read back from disk): the loader hands it nothing

    @classmethod
    def replacing(cls, embedding: torch.nn.Embedding, format: QuantFormat) -> "QuantizedEmbedding":
        """A table for `embedding`'s place: quantized from its weight, unless that is still on the meta
        device (a skeleton being loaded: `take_weight` fills it)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, format)
        carry_mark(embedding, layer)  # held in host memory if the plan put it there
        if not embedding.weight.is_meta:
            layer.take_weight("weight", embedding.weight.detach())
        return layer

    def take_weight(self, name: str, tensor: torch.Tensor) -> None:
        """The checkpoint's table, quantized on its device."""
        assert name == "weight" and tensor.shape == (self.num_embeddings, self.embedding_dim), (name, tensor.shape)
        weight = quantize(tensor, self.format)
        # int8's scales in the model's dtype, as a QuantizedLinear keeps them (formats.quantized_bytes).
        scales = weight.scales.to(tensor.dtype) if self.format == "int8" else weight.scales
        self.hold(placed(self, weight.values, tensor.device), placed(self, scales, tensor.device), tensor.dtype)

    def hold(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep a quantized table (made here, or read back from disk) for a model in `dtype`."""
        self.values, self.scales, self.dtype = values, scales, dtype

    @property
    def empty(self) -> bool:
        """Whether it holds no table yet (swapped into a model not loaded yet)."""
        return self.values is None

    def planned_bytes(self, dtype: torch.dtype) -> int:
        """The bytes its quantized table will take once loaded, in a model of `dtype`."""
        return quantized_bytes((self.num_embeddings, self.embedding_dim), self.format, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(Quantized(self.format, self.values[ids], self.scales[ids]), self.dtype)  # [*ids.shape, H]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format}"
