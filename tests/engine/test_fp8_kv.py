"""The Thinker's KV in fp8 (`kv_dtype = "fp8"`, engine/memory/kv_fp8.py): each (token, kv head)'s row stored
as float8 e4m3 with a float32 scale; written quantized by every writer, read as values x scale by our
kernel (Triton's interpreter on the CPU run) and the torch path alike; its scales carried with its
blocks to host memory and back; counted at its own bytes by the memory plan; the same greedy replies
with the prefix cache on and off, spoken too (the Talker's KV is fp8 as well); refused on a GPU
without FP8."""

import pytest
import torch

from chats import Chat, SpokenChat, written
from paged_kv import FLOAT32, SCALING, case_inputs, full_size, on_cpu, on_gpu, paged_call
from samples import picture
from omni_local.engine.memory import kv_fp8
from omni_local.engine.memory.attention import gathered_attention
from omni_local.engine.memory.host_arena import HostArena
from omni_local.engine.memory.kv_fp8 import FP8, write_rows
from omni_local.engine.memory.kv_store import NO_PREFIX, GraphedKVWriter, KVShape, KVStore
from omni_local.engine.sizing import memory_plan
from omni_local.errors import SettingsError
from omni_local.kernels import triton_support
from omni_local.kernels.attention.paged import paged_attention
from omni_local.kernels.triton_support import FORCE_ARCH_VARIABLE
from omni_local.model import load_model
from omni_local.model.quantized.formats import dequantize, quantize

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=8, max_tokens=64, talker_dim=3, block_tokens=4, fp8=True)
DEMO_FP8_TOKEN_BYTES = 2 * 4 * 2 * (32 + 4)  # K and V x 4 layers x 2 kv heads x (32 fp8 values + a float32 scale)


def fp8_pools(key_pool: torch.Tensor, value_pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(key values, value values, key scales, value scales): the pools' rows quantized as the writers
    quantize them (rows that are no sequence's hold NaN, and stay NaN)."""
    keys, values = quantize(key_pool, "fp8"), quantize(value_pool, "fp8")
    return keys.values, values.values, keys.scales, values.scales


CASES = ["decode tokens of sequences of uneven lengths", "a group of 8 query heads per kv head, as the Thinker's",
         "a decode token whose rows need longer splits than the fewest, beside a short one",
         "causal tails of new tokens on cached prefixes, one empty", "a tail of two query tiles in the Thinker's group of 8"]


@on_cpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_kernel_over_fp8_pools_matches_the_reference_reading_the_same_rows(case, batch_invariant):
    query, query_rows, kv = case_inputs(case, torch.float32)
    key_values, value_values, key_scales, value_scales = fp8_pools(kv.key_pool, kv.value_pool)
    kv.key_pool, kv.value_pool = key_values, value_values
    scales = (key_scales, value_scales)

    ours = paged_call(paged_attention, query, kv, query_rows, scales=scales, batch_invariant=batch_invariant)

    assert ours.isfinite().all()
    torch.testing.assert_close(ours, paged_call(gathered_attention, query, kv, query_rows, scales=scales), **FLOAT32)


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize(("batch", "context", "length"), [(1, 4096, 1), (16, 1024, 1), (2, 1024, 100)])
@torch.inference_mode()
def test_the_kernel_at_full_size_over_fp8_pools_is_within_bfloat16_rounding_of_the_same_rows_in_float32(
        batch, context, length):
    query, query_rows, kv = full_size(batch, context, length)
    key_values, value_values, key_scales, value_scales = fp8_pools(kv.key_pool, kv.value_pool)
    kv.key_pool, kv.value_pool = key_values, value_values
    scales = (key_scales, value_scales)
    exact = paged_call(gathered_attention, query.float(), kv, query_rows, scales=scales)

    ours = paged_call(paged_attention, query, kv, query_rows, scales=scales).float()

    assert ((ours - exact).norm() / exact.norm()).item() <= 0.01  # one bfloat16 rounding is 0.4% of a value


def test_the_reference_reads_an_fp8_pools_rows_as_values_times_scales():
    query, query_rows, kv = case_inputs("causal tails of new tokens on cached prefixes, one empty", torch.float32)
    key_values, value_values, key_scales, value_scales = fp8_pools(kv.key_pool, kv.value_pool)
    dequantized = [dequantize(quantize(pool, "fp8"), torch.float32) for pool in (kv.key_pool, kv.value_pool)]

    read = gathered_attention(query, key_values, value_values, kv.block_tables, query_rows, SCALING,
                              scales=(key_scales, value_scales))

    assert torch.equal(read, gathered_attention(query, *dequantized, kv.block_tables, query_rows, SCALING))


def rows(count: int, seed: int) -> torch.Tensor:
    """`count` rows [count, kv_heads, head_dim] of keys, of magnitudes from 0.01 to 100 by head."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.tensor([0.01, 100.0])[None, :, None]
    return torch.randn((count, SHAPE.kv_heads, SHAPE.head_dim), generator=generator) * magnitude


def written_store(count: int) -> tuple[KVStore, list[int], list[torch.Tensor]]:
    """An fp8 store with a sequence of `count` rows written by `write_rows` in every layer, its table,
    and the rows written (layer by layer, keys then values)."""
    store = KVStore(SHAPE, 12, torch.float32, torch.device("cpu"))
    table = store.take(SHAPE.blocks_for(count))
    _, blocks, offsets = store.addresses(store.device_table(table), 0, count)
    made = []
    for layer in range(SHAPE.num_layers):
        for kind, (pool, scales) in enumerate(zip((store.keys[layer], store.values[layer]), store.scales[layer])):
            made.append(rows(count, seed=2 * layer + kind))
            write_rows(pool, scales, blocks, offsets, made[-1])
    return store, table, made


def read(store: KVStore, table: list[int], count: int) -> list[torch.Tensor]:
    """The sequence's first `count` rows, each layer's keys then values [count, kv_heads, head_dim],
    as the torch path's writers read them."""
    writer = store.writer(table, 0)
    writer.places(count)
    out = []
    for layer in range(SHAPE.num_layers):
        out.extend(t[0].transpose(0, 1) for t in writer.attended_rows(None, None, layer))
    return out


def test_an_fp8_store_keeps_each_rows_values_and_scale_and_reads_them_as_quantized():
    store, table, made = written_store(10)

    assert store.keys[0].dtype == FP8 and store.scales[0][0].shape == (12, SHAPE.kv_heads, SHAPE.block_tokens)
    for got, rows_written in zip(read(store, table, 10), made):
        assert torch.equal(got, dequantize(quantize(rows_written, "fp8"), torch.float32))
        torch.testing.assert_close(got, rows_written, rtol=2 ** -4, atol=0)  # e4m3: 3 mantissa bits


def test_an_fp8_sequence_moved_to_host_memory_and_back_reads_the_same_bits():
    store, table, _ = written_store(10)
    before = read(store, table, 10)
    host = store.to_host(table, 10)
    again = store.take(SHAPE.blocks_for(10))

    store.from_host(host, again, 10)

    assert host.nbytes == 10 * SHAPE.token_bytes(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(read(store, again, 10), before))


def test_an_fp8_sequence_saved_in_the_host_arena_and_loaded_into_other_blocks_reads_the_same_bits():
    store, table, _ = written_store(10)
    before = read(store, table, 10)
    arena = HostArena(store, 6)
    saved = arena.save(table, 10)
    again = store.take(SHAPE.blocks_for(10))

    arena.load(saved, again, 10)

    assert saved.nbytes == SHAPE.blocks_for(10) * SHAPE.block_bytes(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(read(store, again, 10), before))


def test_a_shared_fp8_blocks_copy_and_a_zeroed_block_carry_their_scales():
    store, table, _ = written_store(6)
    before = read(store, table, 6)
    copy = store.take(SHAPE.blocks_for(6))
    store.copy_block(table[0], copy[0], SHAPE.block_tokens)
    store.copy_block(table[1], copy[1], 2)

    assert all(torch.equal(a, b) for a, b in zip(read(store, copy, 6), before))
    store.scrub(copy)
    assert all(not rows_read.any() for rows_read in read(store, copy, 6))


def test_a_graphs_first_prefill_in_an_fp8_store_attends_over_its_rows_as_written_not_as_computed():
    store = KVStore(SHAPE, 12, torch.float32, torch.device("cpu"))
    table = store.take(2)
    keys, values = rows(6, seed=0), rows(6, seed=1)  # [6, kv_heads, head_dim]: one sequence's first 6 tokens
    blocks = torch.tensor([[table[0]] * 4 + [table[1]] * 2])
    offsets = torch.tensor([[0, 1, 2, 3, 0, 1]])
    writer = GraphedKVWriter(store, torch.tensor([table]), torch.arange(6)[None], blocks, offsets,
                             torch.tensor([5]), NO_PREFIX)
    pools, scales = writer.pools(0), writer.scales(0)
    for pool, scale, new in zip(pools, scales, (keys, values)):
        write_rows(pool, scale, *writer.places(6), new)

    attended = writer.attended_rows(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], 0)

    for got, new in zip(attended, (keys, values)):
        assert torch.equal(got, dequantize(quantize(new, "fp8"), torch.float32).transpose(0, 1)[None])


def test_an_fp8_tokens_bytes_are_its_fp8_values_and_scales_and_its_talker_row():
    assert SHAPE.token_bytes(torch.bfloat16) == 2 * 2 * 2 * (8 + 4) + 3 * 2


def test_the_memory_plan_counts_fp8_kv_at_its_own_bytes(demo_settings, demo_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", 1 << 20)
    settings = demo_settings.replace(gpu_memory_bytes=1 << 30, gpu_cache_bytes=8 << 20, cache_dir=str(tmp_path))
    model = load_model(settings).model

    plans = {kv: memory_plan.plan_memory(model, settings.replace(kv_dtype=kv), torch.device("cpu"))
             for kv in ("auto", "fp8")}

    block_tokens = settings.kv_block_tokens
    assert plans["auto"].kv_tokens == ((8 << 20) // (block_tokens * 2048) - 1) * block_tokens
    assert plans["fp8"].kv_tokens == ((8 << 20) // (block_tokens * DEMO_FP8_TOKEN_BYTES) - 1) * block_tokens


@pytest.fixture
def forced_arch(monkeypatch):
    """Makes the GPU the one OMNI_LOCAL_FORCE_ARCH names (`forced_arch("86")`): no GPU needed."""

    def force(arch: str) -> None:
        monkeypatch.setenv(FORCE_ARCH_VARIABLE, arch)
        triton_support._cuda_gpu.cache_clear()

    yield force
    triton_support._cuda_gpu.cache_clear()


def test_kv_dtype_fp8_is_refused_on_a_gpu_below_compute_capability_8_9_saying_what_to_use(forced_arch):
    forced_arch("86")

    with pytest.raises(SettingsError) as refused:
        kv_fp8.fp8_kv("fp8", torch.device("cuda"))

    assert str(refused.value) == ("setting 'kv_dtype' is 'fp8', but this GPU's compute capability is 8.6, and fp8 "
                                  "needs 8.9 or newer (Ada, Hopper, Blackwell): use kv_dtype = 'auto' (the default; "
                                  "weights = 'int4' leaves the KV more memory)")
    assert kv_fp8.fp8_kv("auto", torch.device("cuda")) is False


def test_kv_dtype_fp8_runs_on_a_gpu_with_fp8_and_on_the_cpu(forced_arch):
    forced_arch("89")

    assert kv_fp8.fp8_kv("fp8", torch.device("cuda")) and kv_fp8.fp8_kv("fp8", torch.device("cpu"))


@pytest.fixture(scope="module")
def fp8_apps(demo_settings, make_apps):
    return make_apps(demo_settings.replace(kv_dtype="fp8"))


def test_with_fp8_kv_a_chat_about_a_picture_answers_the_same_with_the_cache_on_and_off(fp8_apps):
    cached = fp8_apps[0].backend.engine.runner.kv
    chat = Chat(fp8_apps, "You describe pictures in detail.", new_tokens=8)

    first = chat.send("Describe this.", images=[picture(2, (160, 120))])
    second = chat.send("And what is in the corner?")
    third = chat.send("Thank you!")

    assert cached.keys[0].dtype == FP8
    assert second.tokens.reused_gpu == written(first) and third.tokens.reused_gpu == written(second)


@pytest.fixture(scope="module")
def fp8_speaking_apps(demo_settings, make_apps):
    return make_apps(demo_settings.replace(kv_dtype="fp8", speech=True, max_speech_seconds=1.0))


def test_with_fp8_kv_the_talker_keeps_fp8_kv_too_and_a_spoken_chat_speaks_the_same_with_the_cache_on_and_off(
        fp8_speaking_apps):
    chat = SpokenChat(fp8_speaking_apps, "You look and listen.")

    chat.send("What is this?", images=[picture(3, (160, 120))])
    second = chat.send("Tell me more.")

    assert fp8_speaking_apps[0].backend.engine.speaker.runner.kv.keys[0].dtype == FP8
    assert second.speech.talker_reused > 0  # the first turn's Talker KV, read back from its fp8 blocks
