"""Decoder layers run split around their cache write: eagerly that is transformers' own layer, bit
for bit; compiled, the same within float tolerance, and no prefill length recompiles it."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache
from transformers.utils.output_capturing import install_all_output_capturing_hooks

from omni_local.engine.forward.decoder_stack import LayerRegions, run_layers
from omni_local.engine.memory.kv_store import GraphedKVWriter, KVShape, KVStore

# float32 on the CPU: inductor fuses and reorders sums, so compiled outputs differ from eager in the
# last bits.
TOLERANCE = dict(rtol=1e-4, atol=1e-4)

# Inductor's CPU backend imports a TorchScript module of torch's own, which warns on import.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def stacks(model) -> dict[str, torch.nn.Module]:
    return {"thinker": model.thinker.model.language_model, "talker": model.talker.model,
            "code predictor": model.talker.code_predictor.model}


def positions_for(stack: torch.nn.Module, start: int, length: int) -> torch.Tensor:
    """Positions [3, 1, n] for a stack with 3D rotary positions, [1, n] for one with plain ones."""
    flat = torch.arange(start, start + length, device=stack.norm.weight.device)[None]
    return flat.expand(3, 1, -1) if getattr(stack.rotary_emb, "mrope_section", None) else flat


def hidden_states(stack: torch.nn.Module, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = stack.norm.weight
    return torch.randn((1, length, stack.config.hidden_size), generator=generator).to(weight.device, weight.dtype)


@pytest.mark.parametrize("name", ["thinker", "talker", "code predictor"])
@torch.inference_mode()  # as the engine runs them: its KV pools are views of one tensor, written in place
def test_a_split_layer_is_transformers_own_layer_bit_for_bit(speaking_app, name):
    stack = stacks(speaking_app.backend.loaded.model)[name]
    config, weight = stack.config, stack.norm.weight
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_tokens=16)
    ours, theirs = KVStore(shape, shape.table_blocks + 1, weight.dtype, weight.device), DynamicCache(config=config)
    table = ours.take(shape.table_blocks)
    regions = LayerRegions()
    start = 0
    for length in (7, 1, 1):  # a prefill with the causal rule, then decode steps reading the cache
        hidden = hidden_states(stack, length, seed=start)
        rotary = stack.rotary_emb(hidden, positions_for(stack, start, length))
        for layer, next_norm in zip(stack.layers, [layer.input_layernorm for layer in stack.layers[1:]] + [stack.norm]):
            expected = layer(hidden, attention_mask=None, cache=theirs, position_embeddings=rotary)
            got, normed = regions.run(layer, hidden, layer.input_layernorm(hidden), None, ours.writer(table, start),
                                      rotary, next_norm)
            assert torch.equal(got, expected) and torch.equal(normed, next_norm(expected))
            hidden = expected
        start += length


@pytest.mark.parametrize("name", ["thinker", "talker"])
@torch.inference_mode()  # as the engine runs them
def test_compiled_layers_match_eager_and_one_graph_serves_every_prefill_length_and_store(speaking_app, name):
    stack = stacks(speaking_app.backend.loaded.model)[name]
    config = stack.config
    # The router hooks transformers installs at its first forward (the Talker's, in a spoken
    # `generate`): compiled layers must get past them.
    install_all_output_capturing_hooks(stack)
    assert stack.layers[0].mlp.gate._forward_hooks
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_tokens=128)
    weight = stack.norm.weight
    stores = {compiled: KVStore(shape, shape.table_blocks + 1, weight.dtype, weight.device) for compiled in (False, True)}
    tables = {compiled: stores[compiled].take(shape.table_blocks) for compiled in (False, True)}
    regions = {compiled: LayerRegions(compiled) for compiled in (False, True)}
    start = 0
    for length in (9, 13, 1, 1, 21):  # a prefill, a second one, decode steps, a third prefill
        embeds = hidden_states(stack, length, seed=100 + start)
        positions = positions_for(stack, start, length)
        if length == 21:
            graphs = counters["stats"]["unique_graphs"]  # dynamo counts a recompile as a graph too
        eager, compiled = (run_layers(stack, stores[c].writer(tables[c], start), embeds, positions,
                                      regions=regions[c])[0] for c in (False, True))
        torch.testing.assert_close(compiled, eager, **TOLERANCE)
        start += length
    torch.testing.assert_close(stores[True].to_host(tables[True], start).kv,
                               stores[False].to_host(tables[False], start).kv, **TOLERANCE)
    # Once a prefill and a decode step have compiled, the third prefill length, like any later one,
    # reuses a graph.
    assert counters["stats"]["unique_graphs"] == graphs
    # Nor does a store of another size (another app's, the Talker's): its pools are inputs too.
    larger = KVStore(shape, 3 * shape.table_blocks + 1, weight.dtype, weight.device)
    table = larger.take(shape.table_blocks)
    run_layers(stack, larger.writer(table, 0), hidden_states(stack, 5, seed=7), positions_for(stack, 0, 5),
               regions=regions[True])
    # Nor a graph's prefill, whose places are views of its buffers for the longest length (strided).
    run_layers(stack, padded_prefill(larger, table, length=6, longest=32), hidden_states(stack, 6, seed=8),
               positions_for(stack, 0, 6), regions=regions[True])
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("name", ["thinker", "talker"])
@torch.inference_mode()
def test_compiled_layers_over_our_attention_kernel_leave_it_the_queries_norm_and_rotation(speaking_app, name):
    from omni_local.kernels.attention.paged import paged_attention

    stack = stacks(speaking_app.backend.loaded.model)[name]
    config, weight = stack.config, stack.norm.weight
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_tokens=32)
    stores = {c: KVStore(shape, shape.table_blocks + 1, weight.dtype, weight.device) for c in (False, True)}
    tables = {c: stores[c].take(shape.table_blocks) for c in (False, True)}
    regions = {c: LayerRegions(c) for c in (False, True)}
    start = 0
    for length in (9, 1, 1):  # a prefill over the kernel, then decode steps
        embeds = hidden_states(stack, length, seed=200 + start)
        positions = positions_for(stack, start, length)
        eager, compiled = (run_layers(stack, stores[c].writer(tables[c], start, paged_attention), embeds, positions,
                                      regions=regions[c])[0] for c in (False, True))
        torch.testing.assert_close(compiled, eager, **TOLERANCE)
        start += length
    torch.testing.assert_close(stores[True].to_host(tables[True], start).kv,
                               stores[False].to_host(tables[False], start).kv, **TOLERANCE)


def padded_prefill(store: KVStore, table: list[int], length: int, longest: int) -> GraphedKVWriter:
    """The writer of a prefill graph of `length` new tokens at the start of `table`, its indices,
    blocks and offsets [1, length] views of [1, longest] buffers, as BatchGraphs holds them."""
    rows = torch.arange(longest, device=store.device)
    indices = rows[None]
    blocks = torch.tensor(table, device=store.device)[rows // store.shape.block_tokens][None]
    offsets = (rows % store.shape.block_tokens)[None]
    tables = torch.tensor([table], device=store.device)
    last = torch.tensor([length - 1], device=store.device)
    return GraphedKVWriter(store, tables, indices[:, :length], blocks[:, :length], offsets[:, :length], last,
                           rows=store.shape.max_tokens)


def store_for(stack: torch.nn.Module, **kind: object) -> KVStore:
    """A store of 32 rows a sequence for `stack`, of the `kind` given (KVShape's fields)."""
    shape = KVShape(stack.config.num_hidden_layers, stack.config.num_key_value_heads, stack.config.head_dim,
                    max_tokens=32, **kind)
    weight = stack.norm.weight
    return KVStore(shape, shape.table_blocks + 1, weight.dtype, weight.device)


def prefill_of_five(stack: torch.nn.Module, regions: LayerRegions, store: KVStore | None = None,
                    **kind: object) -> None:
    """Five tokens into fresh blocks of `store` (or of a new store of the `kind` given), each layer as
    `regions` runs it."""
    store = store or store_for(stack, **kind)
    run_layers(stack, store.writer(store.take(store.shape.table_blocks), 0), hidden_states(stack, 5, seed=9),
               positions_for(stack, 0, 5), regions=regions)


@torch.inference_mode()
def test_each_kind_of_layer_compiles_regions_of_its_own_which_another_app_of_that_kind_reuses(speaking_app):
    # Dynamo compiles a function at most `recompile_limit` times, then fails (fullgraph): a process
    # holding many kinds of layer (a test run's apps: quantized, deterministic, ...) must not get there.
    stack = stacks(speaking_app.backend.loaded.model)["thinker"]
    projections = [layer.self_attn.o_proj for layer in stack.layers]
    classes = [type(projection) for projection in projections]
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            for kind in range(3):  # o_proj swapped for a class of its own: a kind of layer the guards tell apart
                swapped = {own: type(f"{own.__name__}{kind}", (own,), {}) for own in set(classes)}
                for projection, own in zip(projections, classes):
                    projection.__class__ = swapped[own]
                prefill_of_five(stack, LayerRegions(compiled=True))
            graphs = counters["stats"]["unique_graphs"]
            prefill_of_five(stack, LayerRegions(compiled=True))  # a new LayerRegions: another app's
    finally:
        for projection, own in zip(projections, classes):
            projection.__class__ = own
    assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def test_each_kind_of_store_compiles_regions_of_its_own_so_no_process_of_many_stores_recompiles_one(speaking_app):
    # A test run's apps keep their KV in stores of other block sizes and dtypes: a region compiled
    # again for each would reach dynamo's limit, and fail, in one process.
    stack = stacks(speaking_app.backend.loaded.model)["thinker"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for store in ({"block_tokens": 16}, {"block_tokens": 32}, {"block_tokens": 16, "fp8": True}):
            prefill_of_five(stack, LayerRegions(compiled=True), **store)
        graphs = counters["stats"]["unique_graphs"]
        prefill_of_five(stack, LayerRegions(compiled=True), block_tokens=32)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def test_a_store_made_under_inference_mode_reuses_the_regions_compiled_for_the_engines(speaking_app):
    # The engine makes its stores outside inference mode and runs its forwards under it; a store made
    # under it (a test's, a tool's) must not compile the regions again: with dynamo's limit reached,
    # that failed a GPU test run in one order and not in another.
    stack = stacks(speaking_app.backend.loaded.model)["thinker"]
    with torch.inference_mode(False):
        engines = store_for(stack)
    prefill_of_five(stack, LayerRegions(compiled=True), engines)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1):
        prefill_of_five(stack, LayerRegions(compiled=True))
    assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def test_another_moe_backend_compiles_only_the_region_after_attention_again(speaking_app):
    from omni_local.engine.forward.moe.triton_backend import TritonMoe

    stack = stacks(speaking_app.backend.loaded.model)["thinker"]
    prefill_of_five(stack, LayerRegions(compiled=True))
    graphs = counters["stats"]["unique_graphs"]

    # A class of its own: on a GPU the app's layers already compiled TritonMoe's region.
    another = type("AnotherMoe", (TritonMoe,), {})()
    prefill_of_five(stack, LayerRegions(compiled=True, moe=another))

    assert counters["stats"]["unique_graphs"] == graphs + 1
