"""One forward of a transformers decoder stack (the Thinker's, the Talker's or its code
predictor's) over a sequence's blocks of a KVStore.

The layers' modules, rotary embedding and norm are transformers' own; we pass the cache (a
KVWriter, or in a CUDA graph a GraphedKVWriter), its mask and the 3D positions ourselves. Each
decoder layer runs as transformers' forward does, the same operations in the same order, but split
in three around attention: the work before it (projections, rotary embedding, the new rows' write
into the cache), attention, and the work after (output projection, norm, MLP or MoE, the MoE's
routed experts run by a MoeBackend, and the next layer's input norm of the output).
`LayerRegions(compiled=True)` runs the halves before and after as compiled regions: inductor fuses
their elementwise work (each RMSNorm is six kernels eager, the rotary embedding a dozen, the MoE
router several, the cache write two), which a CUDA graph alone replays one kernel at a time. Over our
attention kernel, the queries' norm and rotary embedding are done by that kernel as it loads them
(one launch a layer fewer), and the norms outside the layers (the first layer's input, the stack's
last) by our one-kernel RMSNorm.
"""

import sys
import types
from collections.abc import Callable, Hashable, Iterable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from omni_local.engine.forward.fused_qkv import split_qkv
from omni_local.engine.forward.moe import TORCH, MoeBackend, mlp_output
from omni_local.engine.forward.moe.block import is_sparse_moe
from omni_local.engine.forward.rope_positions import rope_positions
from omni_local.engine.memory.host_copies import to_device
from omni_local.engine.memory.kv_fp8 import write_rows
from omni_local.engine.memory.kv_store import GraphedKVWriter, KVWriter, PackedKVWriter
from omni_local.engine.prompt.builder import Prompt
from omni_local.kernels.attention import QueryNormRope


def attention_inputs(layer: torch.nn.Module, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     blocks: torch.Tensor, offsets: torch.Tensor, *, key_pool: torch.Tensor, value_pool: torch.Tensor,
                     key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                     kernel_prepares_queries: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's queries, keys and values [B, heads, n, head_dim] for `normed` [B, n, hidden],
    its input through its input_layernorm (made with the layer before's output:
    `attention_output_and_mlp`): its forward from there up to the cache write, the three projections
    as one (`fuse_qkv` made it), and the write: token (b, l)'s key and value into row `offsets[i]` of
    block `blocks[i]` of the pools, i = b * n + l (fp8 pools' quantized, their scales into `key_scales`
    and `value_scales`: kv_fp8.py). Compiled, the write is stored by the kernel that makes the keys
    (no launch of its own). With `kernel_prepares_queries`, the queries are the
    projection's alone: the attention kernel norms and rotates them as it loads them (`LayerRegions.run`).
    The places come flat: [B * n] tensors have one stride whatever view of a graph's buffer they were
    (a strided [B, n] view would be a guard of its own, and so another compiled graph)."""
    attention = layer.self_attn
    shape = (*normed.shape[:-1], -1, attention.head_dim)
    queries, keys, values = split_qkv(attention, normed)
    queries = queries.reshape(shape)
    keys = attention.k_norm(keys.reshape(shape)).transpose(1, 2)
    values = values.reshape(shape).transpose(1, 2)
    if kernel_prepares_queries:
        # Rotates the keys alone: compiled, nothing computes the query half it returns, which is unused.
        queries = queries.transpose(1, 2)
        _, keys = _modeling(attention).apply_rotary_pos_emb(keys, keys, cos, sin)
    else:
        queries = attention.q_norm(queries).transpose(1, 2)
        queries, keys = _modeling(attention).apply_rotary_pos_emb(queries, keys, cos, sin)
    # pool[blocks, :, offsets] is [B * n, kv_heads, head_dim]: each new token's row
    write_rows(key_pool, key_scales, blocks, offsets, keys.transpose(1, 2).flatten(0, 1))
    write_rows(value_pool, value_scales, blocks, offsets, values.transpose(1, 2).flatten(0, 1))
    return queries, keys, values


def attention_output_and_mlp(layer: torch.nn.Module, hidden: torch.Tensor, attended: torch.Tensor, *,
                             next_norm: torch.nn.Module, moe: MoeBackend = TORCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output [B, n, hidden] from its input `hidden` and the attention kernel's output
    `attended` [B, n, heads, head_dim] (its forward after the attention, a MoE's experts run by
    `moe`), and that output through `next_norm`, the next layer's input_layernorm. Compiled, the norm
    and the last residual add are one kernel, where the next layer's region would launch the norm
    alone (48 launches a Thinker step)."""
    hidden = hidden + layer.self_attn.o_proj(attended.reshape(*hidden.shape[:-1], -1).contiguous())
    hidden = hidden + mlp_output(layer.mlp, layer.post_attention_layernorm(hidden), moe)
    return hidden, next_norm(hidden)


class LayerRegions:
    """How each decoder layer runs: eagerly, or with the work before and after its cache write
    compiled (one compiled function each for every layer of a kind: the layers of a stack differ
    only in weights, which the compiled code takes as inputs); MoE experts by `moe`."""

    def __init__(self, compiled: bool = False, moe: MoeBackend = TORCH) -> None:
        self.moe = moe
        self.compiled = compiled
        if compiled:
            import omni_local.kernels.rms_norm  # noqa: F401 (registers omni_local::rms_norm; imports Triton)
        self._regions: dict[type, tuple[Callable, Callable]] = {}  # by layer class: the Thinker's, the Talker's, ...

    def run(self, layer: torch.nn.Module, hidden: torch.Tensor, normed: torch.Tensor, mask: torch.Tensor | None,
            cache: KVWriter | GraphedKVWriter | PackedKVWriter, rotary: tuple[torch.Tensor, torch.Tensor],
            next_norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s output for `hidden` [B, n, hidden] (`normed`: `hidden` through the layer's
        input_layernorm), its keys and values written to `cache`, and the output through `next_norm`.
        `mask` is the cache's `attention_mask` (a packed cache's: one for each of its sequences)."""
        before, after = self._regions_for(layer)
        attention = layer.self_attn
        key_pool, value_pool = cache.pools(attention.layer_idx)
        key_scales, value_scales = cache.scales(attention.layer_idx) or (None, None)
        # Compiled, the queries' norm and rotary embedding are a kernel of their own (the keys', with
        # the cache write, another): the attention kernel does them as it loads the queries instead.
        kernel_prepares_queries = self.compiled and cache.attends_in_place
        queries, keys, values = before(layer, normed, *rotary, *cache.places(hidden.shape[1]),
                                       key_pool=key_pool, value_pool=value_pool, key_scales=key_scales,
                                       value_scales=value_scales,
                                       kernel_prepares_queries=kernel_prepares_queries)
        if isinstance(cache, PackedKVWriter):  # each sequence attends to its own rows alone
            attended = torch.cat([_attended(attention, writer, queries[:, :, part], keys[:, :, part],
                                            values[:, :, part], part_mask, (rotary[0][:, part], rotary[1][:, part]),
                                            kernel_prepares_queries)
                                  for (writer, part), part_mask in zip(cache.parts(), mask)], dim=1)
        else:
            attended = _attended(attention, cache, queries, keys, values, mask, rotary, kernel_prepares_queries)
        return after(layer, hidden, attended, next_norm=next_norm, moe=self.moe)

    def norm(self, norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` through `norm`, a transformers RMSNorm outside the layers' regions (a stack's first
        input norm, its final norm). Compiled, by our one-kernel RMSNorm (kernels/rms_norm.py), where
        transformers' is six kernels eager; not a compiled region of its own, which dynamo would trace
        at start-up for every stack and batch shape."""
        if not self.compiled:
            return norm(hidden)
        return torch.ops.omni_local.rms_norm(hidden, norm.weight, norm.variance_epsilon)

    def warm_up_experts(self, layers: Iterable[torch.nn.Module], most_tokens: int) -> None:
        """Runs the MoE backend's warm-up (every kernel for 1 to `most_tokens` tokens) on the first
        of `layers` with routed experts: the layers of a stack differ only in weights."""
        mlp = next((layer.mlp for layer in layers if is_sparse_moe(layer.mlp)), None)
        if mlp is not None:
            self.moe.warm_up(mlp, most_tokens)

    def _regions_for(self, layer: torch.nn.Module) -> tuple[Callable, Callable]:
        if type(layer) not in self._regions:
            eager = (attention_inputs, attention_output_and_mlp)
            self._regions[type(layer)] = self._compiled_regions(layer) if self.compiled else eager
        return self._regions[type(layer)]

    def _compiled_regions(self, layer: torch.nn.Module) -> tuple[Callable, Callable]:
        kind = _layer_kind(layer)  # the MoE backend runs after attention only
        return (_compiled_for_any_batch(attention_inputs, kind),
                _compiled_for_any_batch(attention_output_and_mlp, (kind, _moe_kind(self.moe))))


EAGER = LayerRegions()


def _attended(attention: torch.nn.Module, cache: KVWriter | GraphedKVWriter, queries: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              rotary: tuple[torch.Tensor, torch.Tensor], kernel_prepares_queries: bool) -> torch.Tensor:
    """The attention [B, n, heads, head_dim] of the new tokens' `queries` [B, heads, n, head_dim]
    over their sequences' rows, their `keys` and `values` written already: by our kernel over the
    blocks (Qwen3-Omni's layers have no sliding window), else by transformers' over the rows gathered."""
    if cache.attends_in_place:
        norm_rope = (QueryNormRope(attention.q_norm.weight, attention.q_norm.variance_epsilon, *rotary)
                     if kernel_prepares_queries else None)
        return cache.attend(queries, attention.layer_idx, attention.scaling, norm_rope)
    keys, values = cache.attended_rows(keys, values, attention.layer_idx)
    kernel = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation,
                                                   _modeling(attention).eager_attention_forward)
    attended, _ = kernel(attention, queries, keys, values, mask, dropout=0.0, scaling=attention.scaling,
                         sliding_window=attention.sliding_window)
    return attended


def _modeling(module: torch.nn.Module) -> object:
    """The transformers modeling file `module` is defined in, for its attention helpers."""
    return sys.modules[type(module).__module__]


def _layer_kind(layer: torch.nn.Module) -> Hashable:
    """What a compiled region's guards see of a layer: its modules' classes (quantized or
    deterministic layers swap some) and its tensors' shapes and dtypes (two models of one class, the
    demo model and a checkpoint, differ in sizes)."""
    classes = tuple((name, type(module)) for name, module in layer.named_modules())
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in layer.state_dict().items())
    return classes, tensors


def _moe_kind(moe: MoeBackend) -> Hashable:
    return type(moe), tuple(sorted(vars(moe).items()))


# One kind's graphs (above) may pass dynamo's default limit of 8.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)

# Compiled regions by (region, kind), shared by every LayerRegions of the process (apps on one
# model, a test's many apps): a second app of a kind reuses the first one's graphs.
_COMPILED: dict[tuple[str, Hashable], Callable] = {}


def _compiled_for_any_batch(region: Callable, kind: Hashable) -> Callable:
    """`region(layer, *tensors, ...)` compiled for layers of one kind, its tensors' first two
    dimensions (sequences, new tokens) dynamic: one graph for all prefill lengths, one for all
    batches of decode steps, and one for a single decode step (dynamo specializes a size of 1); with
    quantized weights, batches and prefills of up to GEMV_MAX_ROWS rows (model/quantized/linear.py)
    apart from longer ones.

    Dynamo keeps a function's graphs on its code object and compiles it at most `recompile_limit`
    times (then fails, with fullgraph): every kind of layer (Thinker, Talker, code predictor, each
    with its weights' formats and MoE backend) compiles a copy of the region's code of its own, so
    no number of kinds in one process reaches the limit. The same holds for what the call passes
    besides the dynamic dimensions (a store's dtype, block size and scales, whether the attention
    kernel prepares the queries): each such signature has a copy of its own too."""

    def call(layer: torch.nn.Module, *tensors: torch.Tensor, **keywords: object) -> object:
        for tensor in tensors:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        for value in keywords.values():  # a pool's blocks differ by store (the Thinker's, the Talker's, each app's)
            if isinstance(value, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(value, 0)
        return _compiled_copy(region, (kind, _call_signature(tensors, keywords)))(layer, *tensors, **keywords)

    return call


def _call_signature(tensors: tuple[torch.Tensor, ...], keywords: dict[str, object]) -> Hashable:
    """What dynamo guards on in a region's arguments besides the dimensions `call` marks dynamic
    (the positional tensors' first two, the keyword tensors' first): dtypes, devices, the other
    sizes (with their number), and of the keywords that are not tensors, flags and None by value and
    the rest (a norm, a MoE backend) by class: the layers of a stack pass modules of their own.
    Every tensor of a call is on the layer's device. Made on every eager call: a few microseconds."""
    def keyword(value: object) -> Hashable:
        if isinstance(value, torch.Tensor):
            return value.dtype, value.shape[1:]
        return value if value is None or isinstance(value, bool) else type(value)

    positional = tuple((value.dtype, value.shape[2:], value.dim()) for value in tensors)
    return positional, tuple(keywords), tuple(keyword(value) for value in keywords.values())


def _compiled_copy(region: Callable, kind: Hashable) -> Callable:
    """`region` compiled (fullgraph: a graph break would mean guards of its own) as a copy of its
    code for `kind` alone, made once a process."""
    key = (region.__name__, kind)
    if key not in _COMPILED:
        code = region.__code__.replace(co_name=f"{region.__name__}_{len(_COMPILED)}")
        copy = types.FunctionType(code, region.__globals__, code.co_name, region.__defaults__, region.__closure__)
        copy.__kwdefaults__ = region.__kwdefaults__
        _COMPILED[key] = torch.compile(copy, fullgraph=True)
    return _COMPILED[key]


def run_layers(
    stack: torch.nn.Module,
    cache: KVWriter | GraphedKVWriter | PackedKVWriter,
    embeds: torch.Tensor,
    positions: torch.Tensor | None,
    visual_mask: torch.Tensor | None = None,
    deepstack: list[torch.Tensor] | None = None,
    keep_layer: int | None = None,
    regions: LayerRegions = EAGER,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `embeds` [B, n, hidden] at `positions` [3, B, n] after the rows each sequence's blocks
    already holds (B = 1 except in a graphed batch; a packed cache's sequences are one row of
    tokens, B = 1), each layer as `regions` runs it. A caller whose
    positions never change may pass their `rotary` embedding (cos, sin) instead, made once.

    Returns the normed hidden state [B, 1, hidden] of each sequence's last token (the one
    `cache.last_states` picks) and, if `keep_layer` is given, the hidden states [B, n, hidden]
    transformers reports as `hidden_states[keep_layer]`: the input embeddings for 0, the output of
    layer `keep_layer - 1` (before DeepStack adds to it) up to the last layer, whose output is
    reported normed.
    """
    hidden = embeds
    kept = hidden if keep_layer == 0 else None
    assert (positions is None) != (rotary is None), "positions or their rotary embedding, one of them"
    rotary = rotary if rotary is not None else stack.rotary_emb(hidden, positions)
    mask = cache.attention_mask(stack.config._attn_implementation, hidden.shape[1], hidden)
    last = len(stack.layers)
    # Each layer norms its output for the next one. The last one's is never read (the stack's norm
    # follows), but a norm of another class there (the stack's own) would compile the region again.
    next_norms = [layer.input_layernorm for layer in stack.layers[1:]] + [stack.layers[-1].input_layernorm]
    normed = regions.norm(stack.layers[0].input_layernorm, hidden)
    for index, (layer, next_norm) in enumerate(zip(stack.layers, next_norms)):
        hidden, normed = regions.run(layer, hidden, normed, mask, cache, rotary, next_norm)
        if keep_layer == index + 1 and keep_layer < last:
            kept = hidden
        # DeepStack: the vision encoder's intermediate features join the first decoder layers, at the
        # visual tokens (`visual_mask`), or given dense ([B, n, hidden], zero elsewhere: adding zero
        # changes nothing) where a graph cannot pick rows by a mask. The next layer norms the sum.
        if deepstack is not None and index < len(deepstack):
            level = deepstack[index]
            hidden = stack._deepstack_process(hidden, visual_mask, level) if visual_mask is not None else hidden + level
            normed = regions.norm(next_norm, hidden)
    if keep_layer == last:
        kept = regions.norm(stack.norm, hidden)
        return cache.last_states(kept), kept
    return regions.norm(stack.norm, cache.last_states(hidden)), kept


def mrope_positions(owner: torch.nn.Module, prompt: Prompt, device: torch.device) -> tuple[torch.Tensor, int]:
    """3D positions [3, 1, L] of the prompt's tokens, the ones `owner.get_rope_index` (the Thinker's or
    the Talker's) gives, on `device`, and the delta that places later tokens: token t after the prompt
    is at t + delta. Worked out on the host, from the prompt's media list (rope_positions.py)."""
    positions, delta = rope_positions(prompt, owner.spatial_merge_size, owner.config.position_id_per_seconds)
    return to_device(positions, device), delta
