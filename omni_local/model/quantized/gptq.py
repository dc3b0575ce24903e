"""A GPTQ-packed int4 checkpoint: its `quantization_config` read without GPTQ's packages, and each
layer's stored tensors turned into our int4 (formats.py) by moving bytes, never through bf16. It is
the format AutoRound exports the community's calibrated 4-bit Qwen3-Omni checkpoints in, either as
`quant_method: "gptq"` (AutoRound's GPTQ export, or GPTQModel's own) or as `quant_method:
"auto-round"` with `packing_format: "auto_round:auto_gptq"` (AutoRound's own format, same tensors).

A quantized layer's weight W [N, K] (checkpoint name `<layer>.weight`) is stored as (AutoRound
0.16's `auto_round_extension/torch/qlinear_torch_zp.py`, `QuantLinear.pack_248_bits`, the packing
both of AutoRound's exports use; GPTQModel's QuantLinear has the same tensors with its default
`pack_dtype`, int32):
- `qweight` int32 [K/8, N]: q = round(W / scale) + zero, eight inputs a word, input 8i + j of a
  column in bits 4j..4j+3 of word i; with zero = 8 (symmetric int4: AutoRound's
  `quant_tensor_sym` clamps round(W / scale) to [-8, 7]), q is our nibble, value plus 8. So
  qweight's transpose [N, K/8], read as bytes on a little-endian machine, is our packed [N, K/2];
- `scales` float16 [K/group, N]: ours transposed (a scale may be negative: AutoRound maps a group's
  largest magnitude to -8);
- `qzeros` int32 [K/group, N/8]: the zero point of each group and column, eight a word, stored
  minus 1 in the original (v1) GPTQ format: AutoGPTQ's packing subtracts 1 and its kernels add it
  back, and AutoRound's `auto_round:auto_gptq` does the same ("zp+-1" in AutoRound's
  inference/backend.py). GPTQModel's "gptq_v2" format, and AutoRound's `auto_round` and
  `auto_round:gptqmodel`, store it as it is (GPTQModel's `convert_gptq_v1_to_v2_format_module`
  adds 0x11111111 to each 4-bit word). Our layout has no zero points: every stored nibble must be
  the symmetric zero, 7 or 8 by the format, and is checked as the layer loads;
- `g_idx` int32 [K] (AutoRound's GPTQ export and GPTQModel write it, AutoRound's own format not):
  each input's group. With `desc_act` (activation order) it may be any permutation; we load only
  g_idx[k] = k // group, checked as the layer loads.

Which layers are quantized is what the files hold: a layer stored as `qweight` is packed, any other
keeps its full-precision `weight` (routers, the Talker, the towers, as AutoRound leaves them). The
config says how each packed layer is quantized: `bits`, `group_size`, `sym`, overridden per layer
by GPTQModel's `dynamic` ("+:" or no prefix: a regex over the layer's name, re.match, the first in
order that matches; "-:": not quantized) or AutoRound's `extra_config` (a layer's exact name, else
the first regex, re.search, that matches; `bits` 16 or more: not quantized). A packed layer the
config says is not quantized, or is quantized otherwise than symmetric 4-bit in groups of a power
of two of at least 16 inputs (our kernels' smallest reduction tile), is a `CheckpointError` naming
the field.
"""

import re
from dataclasses import dataclass, field

import torch

from omni_local.errors import CheckpointError
from omni_local.model.quantized.compressed_tensors import Scheme
from omni_local.model.quantized.formats import Quantized

METHODS = ("gptq", "auto-round")
SUPPORTED = ("omni_local loads GPTQ-packed weights that are int4, symmetric (sym true), in groups of a power of "
             "two of at least 16 inputs, with desc_act false (or a g_idx in input order), activations unquantized")
# The stored zero point of symmetric int4 by format: 8 less 1 in GPTQ's v1 format, 8 in v2.
_ZERO_BY_FORMAT = {"gptq": 7, "gptq_v2": 8}
_ZERO_BY_PACKING = {"auto_round:auto_gptq": 7, "auto_round:gptqmodel": 8, "auto_round": 8}
_SETTINGS = ("bits", "group_size", "sym", "data_type", "act_bits")


@dataclass(frozen=True)
class GptqScheme(Scheme):
    """How one packed layer is quantized; `zero` is each qzeros nibble's stored value."""

    zero: int = 7

    @property
    def layout(self) -> str:
        return "gptq"


@dataclass(frozen=True)
class GptqConfig:
    method: str  # quant_method, for messages
    settings: dict  # bits, group_size, sym, ... for every packed layer an override leaves alone
    zero: int
    dynamic: tuple[tuple[re.Pattern, dict | None], ...] = ()  # (regex, overrides or None: not quantized), in order
    extra: dict = field(default_factory=dict)  # AutoRound's extra_config: a layer's name -> overrides
    extra_patterns: tuple[tuple[re.Pattern, dict], ...] = ()  # its keys read as regexes, in order
    quantized_suffixes: tuple[str, ...] = ("qweight",)  # the stored tensor that marks a packed layer

    @property
    def formats(self) -> set[str]:
        return {"int4"}

    def scheme_for(self, names: tuple[str, ...], classes: tuple[str, ...]) -> GptqScheme:
        """The scheme of the packed layer known by `names` (its checkpoint's name and transformers
        5's); a `CheckpointError` if the config does not quantize it so that our int4 holds it."""
        where, overrides = self._overrides(names)
        settings = None if overrides is None else {**self.settings, **overrides}
        if settings is None or settings["bits"] >= 16:
            raise CheckpointError(f"quantization config: {where} leaves {names[0]} unquantized, but the checkpoint "
                                  "holds it GPTQ-packed (its qweight)")
        problems = _problems(settings)
        if problems:
            raise CheckpointError(f"quantization config: {_listed(problems)} for {names[0]}"
                                  f"{f' ({where})' if where else ''}; {SUPPORTED}")
        # Named by method only: experts that entries of equal settings cover are of one scheme.
        return GptqScheme(self.method, "int4", settings["group_size"], self.zero)

    def _overrides(self, names: tuple[str, ...]) -> tuple[str, dict | None]:
        """The entry that sets a layer's own settings, and those ({} for none; None: not quantized)."""
        for pattern, overrides in self.dynamic:
            if any(pattern.match(name) for name in names):
                return f"dynamic entry {pattern.pattern!r}", overrides
        exact = next((name for name in names if name in self.extra), None)
        if exact is not None:
            return f"extra_config entry {exact!r}", self.extra[exact]
        for pattern, overrides in self.extra_patterns:
            if any(pattern.search(name) for name in names):
                return f"extra_config entry {pattern.pattern!r}", overrides
        return "", {}


def read_gptq_config(written: dict) -> GptqConfig:
    """config.json's `quantization_config` of a GPTQ-packed checkpoint (quant_method one of
    METHODS); a `CheckpointError` naming each field that does not map onto our int4."""
    method = written["quant_method"]
    settings = {key: written[key] for key in _SETTINGS if key in written}
    settings.setdefault("bits", 4)
    settings.setdefault("sym", True)
    problems = _problems(settings)
    if method == "gptq":
        format = str(written.get("checkpoint_format") or written.get("format") or "gptq").lower()
        zero = _ZERO_BY_FORMAT.get(format)
        if zero is None:
            problems.append(f"checkpoint_format {format!r} (the GPTQ formats 'gptq' and 'gptq_v2' load)")
    else:
        packing = written.get("packing_format", "auto_round:auto_gptq")  # AutoRound's default, as it reads it
        zero = _ZERO_BY_PACKING.get(packing)
        if zero is None:
            problems.append(f"packing_format {packing!r} ({' or '.join(map(repr, _ZERO_BY_PACKING))} load)")
    dynamic = []
    for entry, overrides in (written.get("dynamic") or {}).items():
        pattern = _compiled(entry.removeprefix("+:").removeprefix("-:"))
        if pattern is None:
            problems.append(f"dynamic entry {entry!r} (not a regex)")
        dynamic.append((pattern, None if entry.startswith("-:") else dict(overrides)))
    if str(written.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        problems.append(f"pack_dtype {written['pack_dtype']!r} (words of int32 load)")
    if problems:
        raise CheckpointError(f"quantization config ({method}): {_listed(problems)}; {SUPPORTED}")
    extra = dict(written.get("extra_config") or {})
    # AutoRound reads a key that names no layer as a regex, and skips one that is not.
    patterns = tuple((pattern, overrides) for key, overrides in extra.items() if (pattern := _compiled(key)))
    return GptqConfig(method, settings, zero, tuple(dynamic), extra, patterns)


def stored_shapes(scheme: GptqScheme, rows: int, inputs: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A packed layer of weight [rows, inputs]: each stored tensor's suffix, shape and safetensors
    dtypes (g_idx, written by some exporters only, among them)."""
    groups = inputs // scheme.group_size
    return {"qweight": ((inputs // 8, rows), ("I32",)), "scales": ((groups, rows), ("F16", "BF16", "F32")),
            "qzeros": ((groups, rows // 8), ("I32",)), "g_idx": ((inputs,), ("I32", "I64"))}


def int4_weight(layer: str, stored: dict[str, torch.Tensor], scheme: GptqScheme, dtype: torch.dtype) -> Quantized:
    """Our int4 of a packed layer's stored tensors (by suffix, on the device), its scales in `dtype`:
    the values' bytes as they are, the words transposed; a `CheckpointError` (naming `layer`) if its
    zero points are not the symmetric zero or its g_idx not in input order."""
    qweight, scales, qzeros = stored["qweight"], stored["scales"], stored["qzeros"]
    word = int.from_bytes(bytes([scheme.zero * 0x11] * 4), "little", signed=True)  # eight nibbles of the zero
    if not bool((qzeros == word).all()):
        raise CheckpointError(f"{layer}.qzeros holds zero points other than the symmetric {scheme.zero} its format "
                              f"stores ({scheme.group}); {SUPPORTED}")
    inputs = qweight.shape[0] * 8
    in_order = torch.arange(inputs, device=qweight.device) // scheme.group_size
    if "g_idx" in stored and not torch.equal(stored["g_idx"].to(in_order.dtype), in_order):
        raise CheckpointError(f"{layer}.g_idx is not in input order (desc_act: activation order, the inputs' groups "
                              f"permuted); {SUPPORTED}")
    values = qweight.t().contiguous().view(torch.uint8)  # [N, K/8] words -> [N, K/2] bytes
    return Quantized("int4", values, scales.t().to(dtype).contiguous(), scheme.group_size)


def _problems(settings: dict) -> list[str]:
    problems = []
    if settings.get("bits", 4) != 4:
        problems.append(f"bits {settings['bits']}")
    group = settings.get("group_size")
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        problems.append(f"group_size {group!r} (a power of two of at least 16 loads)")
    if not settings.get("sym", True):
        problems.append("sym false (asymmetric weights, with zero points)")
    if settings.get("data_type", "int") != "int":
        problems.append(f"data_type {settings['data_type']!r}")
    if settings.get("act_bits", 16) < 16:
        problems.append(f"act_bits {settings['act_bits']} (quantized activations)")
    return problems


def _listed(problems: list[str]) -> str:
    return f"{', '.join(problems)} {'is' if len(problems) == 1 else 'are'} not supported"


def _compiled(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None
