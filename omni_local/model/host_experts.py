"""The routed experts of the Thinker's last layers, and its input embeddings, kept in host memory where
the GPU is too small.

At full size the experts are 93% of the Thinker's weights (13.7 GiB of them in int4), and a decode
step reads only the top-k routed experts of each layer: 8 of 128, about 19 MB a layer in int4. So a
card too small for every layer's experts keeps the last layers' experts in page-locked host memory
(mapped_memory.py), and the MoE kernels read the routed ones over the bus as they read any
other weight: no kernel, graph or forward changes, and nothing is copied back. (Prefill reads more
of each layer's experts, once per prompt chunk.)

The `experts_on_gpu` setting says how many: -1 (AUTO) lets the memory plan (engine/sizing/memory_plan.py)
move the fewest last layers that make its floors fit; N keeps the experts of the first N layers on
the GPU and the rest in host memory (N at or past the layer count: all on the GPU).

Placement is a mark on each experts module (`keep_in_host_memory`, on the empty model before its
weights load): the loader allocates a marked module's tensors in mapped host memory
(`experts_empty`), so they never pass through the GPU's memory whole (int4 and fp8 quantize one
expert's matrix at a time on the GPU, then write it there). A model built whole on the GPU (the
benchmarks' random weights) moves them afterwards, a layer at a time (`move_to_host_memory`).
On the CPU every tensor is in host memory already: the mark changes nothing there.

The Thinker's input embeddings (152,064 rows of 2,048: 594 MiB in bf16, 297 in int4's int8) are read
one row a token, a few KiB over the bus: the plan moves them before any experts. Not where lm_head is
tied to them (one table), which reads all of it every token.
"""

import torch

from omni_local.model.mapped_memory import mapped_copy, mapped_empty

AUTO = -1  # experts_on_gpu: the memory plan decides
_MARK = "experts_in_host_memory"


def thinker_experts(model: torch.nn.Module) -> list[torch.nn.Module | None]:
    """Each Thinker decoder layer's routed experts module, in layer order (None for a dense layer)."""
    return [getattr(layer.mlp, "experts", None) for layer in model.thinker.model.language_model.layers]


def host_layers(layer_count: int, experts_on_gpu: int) -> range:
    """The layers whose experts `experts_on_gpu` (a count, not AUTO) puts in host memory: the last ones."""
    assert experts_on_gpu >= 0, "AUTO is the memory plan's to resolve"
    return range(min(experts_on_gpu, layer_count), layer_count)


def thinker_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Thinker's input embeddings, which may be held in host memory; None where lm_head is tied to them."""
    if "thinker.lm_head.weight" in model.all_tied_weights_keys:
        return None
    return model.thinker.get_input_embeddings()


def keep_in_host_memory(model: torch.nn.Module, experts_on_gpu: int, embeddings: bool) -> None:
    """Mark the experts of the Thinker layers past the first `experts_on_gpu`, and its input embeddings
    if `embeddings`, to be held in host memory when their weights load."""
    for module in _host_modules(model, experts_on_gpu, embeddings):
        setattr(module, _MARK, True)


def _host_modules(model: torch.nn.Module, experts_on_gpu: int, embeddings: bool) -> list[torch.nn.Module]:
    """The modules `experts_on_gpu` and `embeddings` put in host memory."""
    experts = thinker_experts(model)
    table = thinker_embeddings(model) if embeddings else None
    return [m for m in [*(experts[i] for i in host_layers(len(experts), experts_on_gpu)), table] if m is not None]


def in_host_memory(experts: torch.nn.Module) -> bool:
    """Whether `experts` is marked to hold its weights in host memory."""
    return getattr(experts, _MARK, False)


def carry_mark(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """`new`, put in `old`'s place (a quantized layer for a full-precision one), keeps its placement."""
    if in_host_memory(old):
        setattr(new, _MARK, True)


def experts_empty(experts: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """An uninitialised tensor for one of `experts`' weights: in mapped host memory if it is marked,
    else on `device`."""
    if in_host_memory(experts):
        return mapped_empty(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def placed(module: torch.nn.Module, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`, one of `module`'s weights read from anywhere, where `module` holds it: in mapped host
    memory for experts marked so, else on `device`."""
    return mapped_copy(tensor, device) if in_host_memory(module) else tensor.to(device)


def move_to_host_memory(model: torch.nn.Module, experts_on_gpu: int, embeddings: bool) -> None:
    """Move the experts of a loaded model's Thinker layers past the first `experts_on_gpu`, and its
    input embeddings if `embeddings`, to mapped host memory, one module at a time (each one's GPU copy
    is freed before the next is moved), and mark them."""
    for module in _host_modules(model, experts_on_gpu, embeddings):
        if in_host_memory(module):
            continue
        setattr(module, _MARK, True)
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            moved = placed(module, tensor.detach(), tensor.device)
            setattr(module, name, torch.nn.Parameter(moved, requires_grad=False) if name in module._parameters
                    else moved)


def held_in_host_memory(model: torch.nn.Module) -> int:
    """The bytes of the weights held in mapped host memory, experts and embeddings (none on the CPU,
    where it is all host memory)."""
    experts = thinker_experts(model)
    held = [experts[index] for index in layers_in_host_memory(model)]
    held += [thinker_embeddings(model)] if embeddings_in_host_memory(model) else []
    return sum(t.nbytes for module in held for t in _tensors(module))


def layers_in_host_memory(model: torch.nn.Module) -> list[int]:
    """The Thinker layers whose experts are held in mapped host memory (none on the CPU)."""
    return [index for index, experts in enumerate(thinker_experts(model)) if experts is not None and _mapped(experts)]


def embeddings_in_host_memory(model: torch.nn.Module) -> bool:
    """Whether the Thinker's input embeddings are held in mapped host memory (never on the CPU)."""
    table = thinker_embeddings(model)
    return table is not None and _mapped(table)


def _mapped(module: torch.nn.Module) -> bool:
    return in_host_memory(module) and all(t.is_cuda for t in _tensors(module))


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
