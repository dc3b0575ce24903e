"""What a prefill graph computes, run eagerly (on the CPU runs too): through the writer a graph hands
transformers' modules, a prompt padded to a graph's length gives the logits of the prompt's own
eager prefill and writes the same rows: with nothing before it, attending over its own new rows
only; as a tail on a cached prefix, attending with our kernel (Triton's interpreter here) over the
bucket's blocks in place."""

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine.forward.cuda_graphs import attention_buckets
from omni_local.engine.memory.kv_blocks import PAD_BLOCK
from omni_local.engine.memory.kv_store import NO_PREFIX, GraphedKVWriter
from omni_local.engine.prompt.builder import build_prompt
from omni_local.kernels.attention.paged import paged_attention
from omni_local.protocol.messages import Message

TEXT = " ".join(f"Rule {i}: answer the sailor plainly." for i in range(6))


@pytest.fixture(scope="module")
def uncached(demo_settings, demo_checkpoint):
    with OmniLocal(demo_settings.replace(prefix_cache=False, encoder_cache=False)) as app:
        yield app.backend.engine.runner


@torch.inference_mode()
def test_a_padded_first_prefill_through_a_graphs_writer_with_no_prefix_gives_the_eager_prefills_logits_and_rows(
    uncached,
):
    runner, kv = uncached, uncached.kv
    prepared = runner.prepare(build_prompt([Message("user", [TEXT])], runner.encoder.processor), 0, remember=False)
    n, size = prepared.end, kv.shape.block_tokens
    padded = (n // size + 2) * size  # past the sequence's blocks: its padding goes to the pad block
    eager_table, graph_table = kv.take(kv.shape.blocks_for(n)), kv.take(kv.shape.blocks_for(n))
    expected = runner._prefill_step(kv.writer(eager_table, 0), prepared.embeds, prepared.positions)

    logits = through_a_graphs_writer(runner, graph_table, prepared, padded, NO_PREFIX)

    assert_same_logits_and_rows(kv, logits, expected, graph_table, eager_table, n)


@torch.inference_mode()
def test_a_padded_tail_on_a_prefix_through_a_graphs_writer_with_the_kernel_gives_the_eager_prefills_logits_and_rows(
    uncached,
):
    runner, kv = uncached, uncached.kv
    prepared = runner.prepare(build_prompt([Message("user", [TEXT])], runner.encoder.processor), 0, remember=False)
    n = prepared.end
    start, padded = n - 7, 16  # a 7-token tail padded to a graph's 16, past a block's end
    eager_table, graph_table = kv.take(kv.shape.blocks_for(n + padded)), kv.take(kv.shape.blocks_for(n + padded))
    head, tail = prepared.rows(0, start), prepared.rows(start, n)
    for table in (eager_table, graph_table):
        runner._prefill_step(kv.writer(table, 0), head.embeds, head.positions)
    expected = runner._prefill_step(kv.writer(eager_table, start), tail.embeds, tail.positions)

    bucket = next(r for r in attention_buckets(kv.shape.max_tokens) if r >= start + padded)
    logits = through_a_graphs_writer(runner, graph_table, tail, padded, bucket, kernel=paged_attention)

    assert_same_logits_and_rows(kv, logits, expected, graph_table, eager_table, n)


def through_a_graphs_writer(runner, table: list[int], part, padded: int, rows: int, kernel=None) -> torch.Tensor:
    """The logits of `part` (a prepared prompt's new tokens from row `part.start`) padded to `padded`
    tokens as a graph pads them, through the writer a prefill graph of `rows` attention rows hands
    the layers (with `kernel`: attending in place), run eagerly; `table`'s blocks hold the rows."""
    kv, size, device = runner.kv, runner.kv.shape.block_tokens, runner.device
    width = max(kv.shape.blocks_for(part.start + padded), kv.shape.blocks_for(rows))
    tables = torch.tensor([table + [PAD_BLOCK] * (width - len(table))], device=device)
    indices = part.start + torch.arange(padded, device=device)[None]
    length = part.end - part.start
    last = torch.tensor([length - 1], device=device)
    cache = GraphedKVWriter(kv, tables, indices, tables.gather(1, indices // size), indices % size, last, rows, kernel)
    dense = runner._dense_input(part)
    dense = torch.cat([dense, dense.new_zeros((1, padded - length, dense.shape[-1]))], dim=1)
    positions = torch.cat([part.positions, part.positions[:, :, -1:].expand(-1, -1, padded - length)], dim=2)
    return runner._dense_prefill_step(cache, dense, positions)


def assert_same_logits_and_rows(kv, logits: torch.Tensor, expected: torch.Tensor, table: list[int],
                                expected_table: list[int], n: int) -> None:
    torch.testing.assert_close(logits, expected)
    for layer in kv.keys + kv.values:
        torch.testing.assert_close(rows(layer, table, n), rows(layer, expected_table, n))


def rows(layer: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """[kv_heads, n, head_dim]: the first n rows of the sequence in `table`'s blocks of a pool layer."""
    return layer[table].transpose(0, 1).flatten(1, 2)[:, :n]
