"""Qwen3-Omni built with no weights, then filled from the checkpoint's files one tensor at a time.

`from_pretrained` builds the whole model in host memory before it can be moved to the GPU: 66 GB
for the real checkpoint. Here the model's parameters are made on the meta device (no storage) and
each tensor goes from the memory-mapped shard straight to its place on the device, so the host
holds about one tensor at a time. The result is `from_pretrained`'s model, bit for bit.

Quantization plugs in around the same loop (the contract of `load_weights`): `prepare(model)` may
swap modules of the empty model, and a module that defines `take_weight(name, tensor)` (or, for
routed experts, `take_expert_weight(expert, projection, tensor)`) is handed its tensors, on the
device in the model's dtype, instead of having them assigned; one that `prepare` filled itself
(its `prefilled` is true: quantized layers read back from disk) is handed nothing, and its tensors
are not read.

A checkpoint quantized before loading (compressed-tensors or GPTQ: `quantization`) stores its quantized
layers under other names (`...weight_packed`, `...qweight`, ...): those layers are swapped in
for transformers' own before `prepare` runs and are handed their stored tensors as they are, each
layer once all of its have been read (model/quantized/prequantized.py).
"""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import GenerationConfig, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omni_local.errors import CheckpointError
from omni_local.model.checkpoint_names import SPEECH_PARTS, ExpertSlice, expert_slice, fused_rows, model_name, per_expert
from omni_local.model.mapped_memory import mapped_copy
from omni_local.model.host_experts import experts_empty, in_host_memory
from omni_local.model.quantized.prequantized import CheckpointQuantization, PrequantizedLayers

Prepare = Callable[[torch.nn.Module], None]



@dataclass(frozen=True)
class Header:
    """What a file's header says of one tensor."""

    file: str
    shape: torch.Size
    dtype: str  # safetensors' name: "F32", "I32", "F8_E4M3", ...


def load_weights(
    path: Path,
    config: Qwen3OmniMoeConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    prepare: Prepare | None = None,
    quantization: CheckpointQuantization | None = None,
) -> Qwen3OmniMoeForConditionalGeneration:
    """The model of `config` with the weights of the checkpoint in `path`, on `device` in `dtype`.

    `prepare`, if given, is called once on the model before any weight is read, its parameters on
    the meta device; it may replace modules. A module that has `take_weight(name, tensor)` (name: the
    parameter's attribute name, "weight") receives its tensors through it; an experts module that has
    `take_expert_weight(expert, projection, tensor)` (projection: "gate_proj", "up_proj" or
    "down_proj") receives each routed expert's matrices through it; a module whose `prepare` filled
    it (`prefilled` true) receives nothing. Each must leave nothing of its own on the meta device.
    `quantization`, the checkpoint's own, says which layers the files hold quantized. Raises
    `CheckpointError` if the files lack a weight, hold one the model has no place for or of another
    shape (or a quantized layer's tensor of another dtype), cannot be read, or hold a quantized layer
    we cannot load.
    """
    config.name_or_path = str(path)  # as `from_pretrained` records it
    with _parameters_on_meta():
        model = Qwen3OmniMoeForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    expected = checkpoint_shapes(model)
    files = weight_files(path)
    headers = _read_headers(files)
    prequantized, dtypes = None, {}
    if quantization is not None:
        prequantized = PrequantizedLayers.resolve(path, quantization, headers, model, expected)
        expected, dtypes = prequantized.stored_tensors(expected)
    _check_names(path, headers, expected, dtypes, skipped=_skipped_names(model))
    if prequantized is not None:
        prequantized.swap_modules(model)
    if prepare is not None:
        prepare(model)
    with torch.no_grad():
        for file in files:
            _stream_file(model, file, expected, dtype, device, prequantized)
    if prequantized is not None:
        prequantized.check_all_handed_over()
    model.tie_weights()
    _check_materialised(model)
    # The buffers (rotary frequencies, ...) were computed on the host as the model was built.
    model.to(device)
    model.generation_config = _generation_config(path)
    return model


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, or its one file."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return [path / "model.safetensors"]
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    return [path / shard for shard in sorted(set(weight_map.values()))]


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside are moved to the meta device (shape and dtype, no storage);
    buffers keep the values their modules compute, as `from_pretrained` leaves them. Process-wide
    while it lasts, as accelerate's `init_empty_weights(include_buffers=False)`, which transformers
    5 no longer ships."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            # The host tensor is dropped: transformers makes its large ones with `torch.empty`, whose
            # pages are never touched, so they cost no memory.
            on_meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            on_meta.__dict__.update(param.__dict__)
            module._parameters[name] = on_meta

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Every tensor the files must hold, by its (renamed) checkpoint name: the model's parameters and
    persistent buffers, routed experts per expert, tied copies left out (they are tied again)."""
    tied = set(model.all_tied_weights_keys)
    expected: dict[str, torch.Size] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in tied:
            expected.update(per_expert(name, tensor.shape) or {name: tensor.shape})
    return expected


def _skipped_names(model: Qwen3OmniMoeForConditionalGeneration) -> Callable[[str], bool]:
    tied = set(model.all_tied_weights_keys)
    speech_off = not model.has_talker
    return lambda name: name in tied or (speech_off and name.startswith(SPEECH_PARTS))


def _read_headers(files: list[Path]) -> dict[str, Header]:
    """Every tensor's name in the files, with its shape and dtype (safetensors reads only the headers)."""
    headers = {}
    for file in files:
        with _opened(file) as shard:
            for key in shard.keys():
                stored = shard.get_slice(key)
                headers[key] = Header(file.name, torch.Size(stored.get_shape()), stored.get_dtype())
    return headers


def _check_names(
    path: Path, headers: dict[str, Header], expected: dict[str, torch.Size], dtypes: dict[str, tuple[str, ...]],
    skipped: Callable[[str], bool],
) -> None:
    """Refuse the checkpoint before any tensor is read if its names, shapes or (where the layout fixes
    them) dtypes do not fit the model."""
    found: set[str] = set()
    unexpected: list[str] = []
    for key, header in headers.items():
        name = model_name(key)
        if name not in expected:
            if not skipped(name):
                unexpected.append(key)
            continue
        if header.shape != expected[name]:
            raise CheckpointError(f"checkpoint '{path}' holds {key} as {tuple(header.shape)}, but the model "
                                  f"expects {tuple(expected[name])} (in {header.file})")
        if name in dtypes and header.dtype not in dtypes[name]:
            raise CheckpointError(f"checkpoint '{path}' holds {key} in {header.dtype}, but its quantization config "
                                  f"stores it in {' or '.join(dtypes[name])} (in {header.file})")
        found.add(name)
    missing = sorted(expected.keys() - found)
    if missing:
        raise CheckpointError(f"checkpoint '{path}' lacks {len(missing)} weight(s): {_some(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint '{path}' holds {len(unexpected)} weight(s) this model has no place "
                              f"for: {_some(sorted(unexpected))}")


def _stream_file(
    model: torch.nn.Module, file: Path, expected: dict[str, torch.Size], dtype: torch.dtype, device: torch.device,
    prequantized: PrequantizedLayers | None,
) -> None:
    with _opened(file) as shard:
        for key in shard.keys():
            name = model_name(key)
            if prequantized is not None and prequantized.holds(name):
                prequantized.take(model, name, shard.get_tensor(key), device, dtype)  # as stored: no cast
                continue
            if name not in expected or getattr(_owner(model, name), "prefilled", False):
                continue  # skipped, as `_check_names` decided, or its module was filled by `prepare`
            tensor = shard.get_tensor(key)  # a view of the mapped file: its pages are read by the copy
            _place(model, name, tensor, dtype if tensor.is_floating_point() else tensor.dtype, device)


def _owner(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module a (renamed) tensor name goes to: its experts module for a routed expert's matrix."""
    part = expert_slice(name)
    return model.get_submodule(part.module if part is not None else name.rpartition(".")[0])


def _place(model: torch.nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """`tensor` as read from the file, in `dtype`, where its module holds it: on `device`, or a weight
    its module keeps in host memory (the input embeddings, model/host_experts.py) straight there, never
    on the GPU first."""
    part = expert_slice(name)
    if part is not None:
        _place_expert(model.get_submodule(part.module), part, tensor.to(device, dtype))
        return
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if hasattr(owner, "take_weight"):
        owner.take_weight(attribute, tensor.to(device, dtype))
    elif attribute in owner._buffers:
        setattr(owner, attribute, tensor.to(device, dtype))
    else:
        held = mapped_copy(tensor.to(dtype), device) if in_host_memory(owner) else tensor.to(device, dtype)
        setattr(owner, attribute, torch.nn.Parameter(held, getattr(owner, attribute).requires_grad))


def _place_expert(experts: torch.nn.Module, part: ExpertSlice, tensor: torch.Tensor) -> None:
    if hasattr(experts, "take_expert_weight"):
        experts.take_expert_weight(part.expert, part.projection, tensor)
        return
    fused_name, rows = fused_rows(part.projection, intermediate=experts.gate_up_proj.shape[1] // 2)
    fused = getattr(experts, fused_name)
    if fused.is_meta:  # the layer's first expert: its fused parameter is allocated once, then filled
        fused = torch.nn.Parameter(experts_empty(experts, tuple(fused.shape), fused.dtype, tensor.device),
                                   fused.requires_grad)
        setattr(experts, fused_name, fused)
    fused[part.expert, rows].copy_(tensor)


def _check_materialised(model: torch.nn.Module) -> None:
    tensors = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    left = [name for name, tensor in tensors if tensor.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensor(s) are still on the meta device after loading: {_some(left)}; "
                           "a module swapped in by `prepare` must make its own (see `load_weights`)")


def _generation_config(path: Path) -> GenerationConfig:
    # As `from_pretrained` makes it: from generation_config.json, else from config.json's fields.
    try:
        if (path / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(path)
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"could not read the generation settings in '{path}': {error}") from None


def _opened(file: Path) -> safe_open:
    """`file` memory-mapped by safetensors (a context manager); one it cannot read is a
    `CheckpointError` naming it."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"could not load the weights in '{file}': {error}") from None


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
