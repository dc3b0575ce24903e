"""A checkpoint quantized before loading (compressed-tensors, or GPTQ-packed int4: gptq.py): which of its
layers are stored quantized, the tensors each is stored as, and each layer handed its values and
scales once all have been read.

A quantized layer's weight W [N, K] (checkpoint name `<layer>.weight`) is stored as
- int4 (pack-quantized): `<layer>.weight_packed` int32 [N, K/8], eight values a word, the first in
  the lowest bits, each plus 8: read as bytes on a little-endian machine, exactly our packed int4
  [N, K/2] (formats.py); `<layer>.weight_scale` [N, K/group]; `<layer>.weight_shape` int64 (N, K);
- fp8 (float-quantized): `<layer>.weight` float8_e4m3 [N, K] and `<layer>.weight_scale` [N, 1];
- GPTQ-packed int4: `<layer>.qweight`, `.scales`, `.qzeros` and maybe `.g_idx` (gptq.py).
Values keep their bytes; scales take our formats' dtypes (int4's the model's, fp8's float32). No
full-precision copy of a quantized layer is ever made.

Where the layers go: a routed expert's projection (`...mlp.experts.{i}.gate_proj`, a Linear where
the checkpoint was quantized) into its layer's `QuantizedExperts`, whose experts must all be
quantized alike (our kernels read a layer's experts in one format); any other Linear becomes a
`QuantizedLinear`. Embeddings, routers and the two output heads (thinker.lm_head,
talker.codec_head, whose weights the engine reads) stay in the model's dtype: a config that covers
one is refused, naming it.
"""

from collections import Counter, defaultdict
from collections.abc import Collection
from pathlib import Path

import torch

from omni_local.errors import CheckpointError
from omni_local.model.checkpoint_names import expert_slice, model_name
from omni_local.model.quantized import compressed_tensors, gptq
from omni_local.model.quantized.compressed_tensors import SUPPORTED, CompressedTensorsConfig, Scheme
from omni_local.model.quantized.experts import QuantizedExperts
from omni_local.model.quantized.formats import Quantized
from omni_local.model.quantized.linear import QuantizedLinear

CheckpointQuantization = CompressedTensorsConfig | gptq.GptqConfig
# What each of a quantized layer's stored tensors is, by its name's last part, by the scheme's layout.
_STORED_AS = {"int4": {"weight_packed": "values", "weight_scale": "scales", "weight_shape": "shape"},
              "fp8": {"weight": "values", "weight_scale": "scales"},
              "gptq": {name: name for name in ("qweight", "scales", "qzeros", "g_idx")}}
_OPTIONAL = ("g_idx",)  # stored by some exporters only: a layer is complete without it where the files lack it
_SCALE_DTYPES = ("F32", "BF16", "F16")
_OUTPUT_HEADS = ("thinker.lm_head.weight", "talker.codec_head.weight")


def read_quantization_config(config_json: dict) -> CheckpointQuantization | None:
    """The checkpoint's quantization, from config.json's fields: None if it has none; a
    `CheckpointError` naming the first part that does not map onto our formats."""
    written = config_json.get("quantization_config")
    if written is not None and written.get("quant_method") in gptq.METHODS:
        return gptq.read_gptq_config(written)
    return compressed_tensors.read_quantization_config(config_json)


class PrequantizedLayers:
    """The checkpoint's quantized layers, each by its weight's name in transformers 5's module tree
    (a routed expert's per expert: checkpoint_names.py), with the scheme it is stored in."""

    def __init__(self, path: Path, layers: dict[str, Scheme], shapes: dict[str, torch.Size], held: set[str]) -> None:
        """`held`: every tensor name (renamed) the files hold."""
        self.path, self.layers = path, layers
        self._shapes = {weight: shapes[weight] for weight in layers}  # W's [N, K]
        self._parts: dict[str, tuple[str, str]] = {}  # each stored tensor's name: (its layer's weight, what it is)
        for weight, scheme in layers.items():
            for stored, part in _STORED_AS[scheme.layout].items():
                name = f"{weight.removesuffix('.weight')}.{stored}"
                if stored not in _OPTIONAL or name in held:
                    self._parts[name] = (weight, part)
        self._counts = Counter(weight for weight, _ in self._parts.values())  # each layer's stored tensors
        self._read: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # a layer's parts read so far

    @classmethod
    def resolve(cls, path: Path, config: CheckpointQuantization, checkpoint_names: Collection[str],
                model: torch.nn.Module, expected: dict[str, torch.Size]) -> "PrequantizedLayers":
        """The layers of checkpoint `path` that `config` covers, among those whose weights its files
        hold (by `checkpoint_names`) and the model has (`expected`: its weights' names and shapes);
        a `CheckpointError` for a covered layer we cannot load quantized."""
        try:
            layers = _covered_layers(config, checkpoint_names, model, expected)
            _check_experts(layers, expected)
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint '{path}': {error}") from None
        return cls(path, layers, expected, {model_name(name) for name in checkpoint_names})

    @property
    def formats(self) -> set[str]:
        return {scheme.format for scheme in self.layers.values()}

    def stored_tensors(self, expected: dict[str, torch.Size]
                       ) -> tuple[dict[str, torch.Size], dict[str, tuple[str, ...]]]:
        """`expected` (names and shapes) with each quantized weight's stored tensors in its place, and
        the safetensors dtypes those may have."""
        shapes, dtypes = dict(expected), {}
        for weight, scheme in self.layers.items():
            rows, inputs = shapes.pop(weight)
            for suffix, (shape, allowed) in _stored_shapes(scheme, rows, inputs).items():
                name = f"{weight.removesuffix('.weight')}.{suffix}"
                if name in self._parts:
                    shapes[name], dtypes[name] = torch.Size(shape), allowed
        return shapes, dtypes

    def swap_modules(self, model: torch.nn.Module) -> None:
        """On the empty model: a `QuantizedExperts` for each quantized layer of experts, a
        `QuantizedLinear` for each other quantized layer, in the checkpoint's format."""
        swapped = set()
        for weight, scheme in self.layers.items():
            part = expert_slice(weight)
            module = part.module if part is not None else weight.removesuffix(".weight")
            if module in swapped:
                continue
            swapped.add(module)
            original = model.get_submodule(module)
            quantized = (QuantizedExperts.replacing(original, scheme.format) if part is not None
                         else QuantizedLinear.replacing(original, scheme.format))
            quantized.group = scheme.group_size if scheme.format == "int4" else None  # for the memory plan
            model.set_submodule(module, quantized)

    def holds(self, name: str) -> bool:
        """Whether `name` (renamed) is one of the quantized layers' stored tensors."""
        return name in self._parts

    def take(self, model: torch.nn.Module, name: str, tensor: torch.Tensor, device: torch.device,
             dtype: torch.dtype) -> None:
        """One stored tensor, as the file holds it; once its layer's are all read (in any order, from
        any shard), the layer is handed its weight on `device`."""
        weight, part = self._parts[name]
        if part == "shape":
            tensor = tensor.clone()  # read here on the host: its values are checked, never moved
        else:
            tensor = tensor.to(device)
        read = self._read[weight]
        read[part] = tensor
        if len(read) == self._counts[weight]:
            del self._read[weight]
            self._hand_over(model, weight, self._quantized(weight, read, dtype), dtype)

    def check_all_handed_over(self) -> None:
        assert not self._read, f"quantized layers left incomplete: {sorted(self._read)[:3]}"

    def _quantized(self, weight: str, read: dict[str, torch.Tensor], dtype: torch.dtype) -> Quantized:
        scheme = self.layers[weight]
        if scheme.layout == "gptq":
            return gptq.int4_weight(f"checkpoint '{self.path}': {weight.removesuffix('.weight')}", read, scheme, dtype)
        if scheme.format == "fp8":
            return Quantized("fp8", read["values"], read["scales"].to(torch.float32).flatten())
        shape = tuple(read["shape"].tolist())
        if shape != tuple(self._shapes[weight]):
            raise CheckpointError(f"checkpoint '{self.path}' holds {weight.removesuffix('.weight')}.weight_shape as "
                                  f"{shape}, but the model's weight there is {tuple(self._shapes[weight])}")
        return Quantized("int4", read["values"].view(torch.uint8), read["scales"].to(dtype), scheme.group_size)

    @staticmethod
    def _hand_over(model: torch.nn.Module, weight: str, quantized: Quantized, dtype: torch.dtype) -> None:
        part = expert_slice(weight)
        if part is not None:
            model.get_submodule(part.module).take_expert_quantized(part.expert, part.projection, quantized)
        else:
            model.get_submodule(weight.removesuffix(".weight")).take_quantized(quantized, dtype)


def _stored_shapes(scheme: Scheme, rows: int, inputs: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A quantized layer of weight [rows, inputs]: each stored tensor's suffix, shape and dtypes."""
    if scheme.layout == "gptq":
        return gptq.stored_shapes(scheme, rows, inputs)
    if scheme.format == "int4":
        return {"weight_packed": ((rows, inputs // 8), ("I32",)),
                "weight_scale": ((rows, inputs // scheme.group_size), _SCALE_DTYPES),
                "weight_shape": ((2,), ("I64", "I32"))}
    return {"weight": ((rows, inputs), ("F8_E4M3",)), "weight_scale": ((rows, 1), _SCALE_DTYPES)}


def _covered_layers(config: CheckpointQuantization, checkpoint_names: Collection[str], model: torch.nn.Module,
                    expected: dict[str, torch.Size]) -> dict[str, Scheme]:
    layers: dict[str, Scheme] = {}
    for key in checkpoint_names:
        module, _, stored = key.rpartition(".")
        weight = model_name(f"{module}.weight")
        if stored not in config.quantized_suffixes or weight not in expected:
            continue  # not a layer's weight, or one the model has no place for (the loader says so)
        classes = _classes(model, weight)
        scheme = config.scheme_for((module, weight.removesuffix(".weight")), classes)
        if scheme is not None and _is_quantized(module, weight, classes, scheme, expected[weight]):
            layers[weight] = scheme
    return layers


def _classes(model: torch.nn.Module, weight: str) -> tuple[str, ...]:
    """The class names a layer had where the checkpoint was quantized, as compressed-tensors matches
    them: each routed expert's projection was a Linear, and a MoE router counts as one."""
    if expert_slice(weight) is not None:
        return ("Linear",)
    classes = tuple(cls.__name__ for cls in type(model.get_submodule(weight.rpartition(".")[0])).__mro__)
    return (*classes, "Linear") if "Router" in classes[0] else classes


def _is_quantized(module: str, weight: str, classes: tuple[str, ...], scheme: Scheme, shape: torch.Size) -> bool:
    """Whether a layer a scheme covers is stored quantized (compressed-tensors quantizes only Linear
    and Embedding layers), refusing one we keep in the model's dtype or whose inputs its groups do
    not divide."""
    if "Linear" not in classes and "Embedding" not in classes:
        return False
    if "Embedding" in classes or "Router" in classes[0] or weight in _OUTPUT_HEADS:
        raise CheckpointError(f"quantization config {scheme.group} covers {module} ({classes[0]}), which omni_local "
                              f"keeps in the model's dtype (embeddings, MoE routers and output heads); {SUPPORTED}")
    if scheme.format == "int4" and shape[-1] % scheme.group_size:
        raise CheckpointError(f"quantization config {scheme.group}: int4 groups of {scheme.group_size} inputs do not "
                              f"divide the {shape[-1]} inputs of {module}")
    return True


def _check_experts(layers: dict[str, Scheme], expected: dict[str, torch.Size]) -> None:
    """Each layer of routed experts is quantized whole, in one scheme, or not at all."""
    schemes: dict[str, list[Scheme | None]] = defaultdict(list)
    for weight in expected:
        part = expert_slice(weight)
        if part is not None:
            schemes[part.module].append(layers.get(weight))
    for module, found in schemes.items():
        if len(set(found)) > 1:
            kinds = sorted({"full precision" if s is None else f"{s.format} ({s.group})" for s in found})
            raise CheckpointError(f"quantization config: the routed experts of {module} are stored in "
                                  f"{' and '.join(kinds)}; omni_local's kernels read a layer's experts in one format")
