"""A compressed-tensors `quantization_config` (in config.json), read as compressed-tensors 0.20 writes
it, without that package: the format of the community 4-bit and FP8 Qwen3-Omni checkpoints.

Each of its `config_groups` is a scheme (how weights and activations are quantized, and how the
weights are stored: its `format`, else the config's) with `targets`; `ignore` lists layers no
scheme covers. Two schemes map onto our formats (formats.py), and only they load:
- W4A16: `int` weights of 4 bits, symmetric, strategy "group" with a group size a power of two of
  at least 16 (our kernels' smallest reduction tile), stored "pack-quantized", activations not
  quantized: our int4.
- FP8: `float` weights of 8 bits (e4m3), strategy "channel" (a scale per output row), stored
  "float-quantized" (or "naive-quantized", the same bytes), input activations not quantized or
  quantized dynamically per token: our fp8 (whose layers quantize their inputs per token on GPUs
  with FP8 units anyway).
Any other part (asymmetric or 8-bit integers, blocks, static or integer activations, a KV cache
scheme, transforms, another format) is a `CheckpointError` naming it.

A target or an ignore entry is a layer's name, a regex over names ("re:" then the pattern, matched
from the name's start), or a class name ("Linear"), as compressed-tensors matches them: a layer is
covered unless an ignore entry matches it, by the scheme of its most specific target (exact names,
then regexes, then classes; a target two groups name is the later group's).
"""

import re
from dataclasses import dataclass

from omni_local.errors import CheckpointError
from omni_local.model.quantized.formats import QuantFormat

SUPPORTED = ("omni_local loads symmetric int4 weights with group-wise scales (W4A16, pack-quantized) and fp8 "
             "e4m3 weights with per-channel scales (float-quantized), their activations unquantized or fp8 "
             "dynamic per token (FP8)")
_FP8_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Scheme:
    """One config group that maps onto our formats."""

    group: str  # its name in config_groups, for messages
    format: QuantFormat  # "int4" or "fp8"
    group_size: int = 0  # int4: consecutive inputs per scale

    @property
    def layout(self) -> str:
        """How a layer's tensors are stored (prequantized.py): compressed-tensors' for its format."""
        return self.format


@dataclass(frozen=True)
class CompressedTensorsConfig:
    targets: dict[str, Scheme]  # each target, with the scheme it brings
    ignore: tuple[str, ...]
    method: str = "compressed-tensors"  # for messages
    quantized_suffixes: tuple[str, ...] = ("weight", "weight_packed")  # a layer's stored weight, packed or not

    @property
    def formats(self) -> set[str]:
        return {scheme.format for scheme in self.targets.values()}

    def scheme_for(self, names: tuple[str, ...], classes: tuple[str, ...]) -> Scheme | None:
        """The scheme of the layer known by `names` (its checkpoint's name and transformers 5's) whose
        module's classes are `classes`, or None if no scheme covers it."""
        if any(_matches(entry, names, classes) for entry in self.ignore):
            return None
        ordered = sorted(self.targets, key=lambda target: (target.startswith("re:"), target))
        for target in ordered:
            if _name_matches(target, names):
                return self.targets[target]
        for target in ordered:
            if target in classes:
                return self.targets[target]
        return None


def read_quantization_config(config_json: dict) -> CompressedTensorsConfig | None:
    """The checkpoint's quantization, from config.json's fields: None if it has none; a
    `CheckpointError` naming the first part that does not map onto our formats."""
    written = config_json.get("quantization_config")
    if written is None:
        return None
    method = written.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"quantization config: quant_method {method!r} is not supported (omni_local reads "
                              f"checkpoints quantized with compressed-tensors, and GPTQ-packed int4: 'gptq' or "
                              f"'auto-round'); {SUPPORTED}")
    for field, meaning in (("kv_cache_scheme", "a quantized KV cache"), ("transform_config", "weight transforms"),
                           ("sparsity_config", "sparse weights")):
        if written.get(field):
            raise CheckpointError(f"quantization config: {field} ({meaning}) is not supported; {SUPPORTED}")
    status = written.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"quantization config: quantization_status {status!r} is not supported (the weights "
                              f"are not stored quantized); {SUPPORTED}")
    groups = written.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization config: it has no config_groups")
    targets: dict[str, Scheme] = {}
    for name, scheme in groups.items():
        read = _scheme(name, scheme, written.get("format"))
        targets.update(dict.fromkeys(scheme["targets"], read))
    return CompressedTensorsConfig(targets, tuple(written.get("ignore") or ()))


def _scheme(name: str, scheme: object, config_format: str | None) -> Scheme:
    if not isinstance(scheme, dict) or not isinstance(scheme.get("targets"), list):
        raise CheckpointError(f"quantization config {name}: a group is read written out in full, with its targets, "
                              "as compressed-tensors saves it")
    weights = scheme.get("weights")
    inputs = scheme.get("input_activations")
    if weights is None:
        raise CheckpointError(f"quantization config {name}: unquantized weights are not supported; {SUPPORTED}")
    kind, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    strategy = _strategy(weights)
    format = scheme.get("format") or config_format
    problems = []
    if kind == "int" and bits == 4:
        ours, group_size = "int4", weights.get("group_size") or 0
        if strategy != "group":
            problems.append(f"int4 weights of strategy {strategy!r}")
        elif group_size < 16 or group_size & (group_size - 1):
            problems.append(f"int4 groups of {group_size} inputs (a power of two of at least 16 loads)")
        if format != "pack-quantized":
            problems.append(f"format {format!r} for int4 weights")
        if inputs is not None:
            problems.append("quantized input activations with int4 weights")
    elif kind == "float" and bits == 8:
        ours, group_size = "fp8", 0
        if strategy != "channel":
            problems.append(f"fp8 weights of strategy {strategy!r}")
        if format not in _FP8_FORMATS:
            problems.append(f"format {format!r} for fp8 weights")
        problems += _fp8_input_problems(inputs)
    else:
        ours, group_size = None, 0
        problems.append(f"{kind} {bits}-bit weights")
        if inputs is not None:
            problems.append(f"{inputs.get('type', 'int')} {inputs.get('num_bits', 8)}-bit input activations")
    if not weights.get("symmetric", True):
        problems.insert(0, "asymmetric weights (with zero points)")
    if weights.get("actorder") not in (None, "weight", "static"):
        problems.append(f"activation ordering {weights['actorder']!r} (weights stored permuted)")
    if weights.get("dynamic", False):
        problems.append("dynamically quantized weights")
    if scheme.get("output_activations") is not None:
        problems.append("quantized output activations")
    if problems:
        verb = "is" if len(problems) == 1 else "are"
        raise CheckpointError(f"quantization config {name}: {', '.join(problems)} {verb} not supported; {SUPPORTED}")
    return Scheme(name, ours, group_size)


def _fp8_input_problems(inputs: dict | None) -> list[str]:
    if inputs is None:
        return []
    kind, bits = inputs.get("type", "int"), inputs.get("num_bits", 8)
    if (kind, bits) != ("float", 8):
        return [f"{kind} {bits}-bit input activations"]
    if inputs.get("dynamic") is not True:
        return ["static input activations (scales stored in the checkpoint)"]
    if _strategy(inputs) != "token":
        return [f"fp8 input activations of strategy {_strategy(inputs)!r}"]
    return []


def _strategy(args: dict) -> str:
    """A quantization's strategy, inferred from its group size where the config leaves it out, as
    compressed-tensors does."""
    if args.get("strategy"):
        return args["strategy"]
    group_size = args.get("group_size")
    return "tensor" if group_size is None else "channel" if group_size == -1 else "group"


def _matches(entry: str, names: tuple[str, ...], classes: tuple[str, ...]) -> bool:
    return _name_matches(entry, names) or entry in classes


def _name_matches(entry: str, names: tuple[str, ...]) -> bool:
    if entry.startswith("re:"):
        return any(re.match(entry.removeprefix("re:"), name) for name in names)
    return entry in names
