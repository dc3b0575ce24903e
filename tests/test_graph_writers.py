"""What a prefill graph computes, run eagerly (on the CPU runs too): through the writer a graph hands
transformers' modules, a prompt padded to a graph's length gives the logits of the prompt's own
eager prefill and writes the same rows: with nothing before it, attending over its own new rows
only; as a tail on a cached prefix, attending with our kernel (Triton's interpreter here) over the
bucket's blocks in place."""

import torch

from omni_local.api import OmniLocal
from omni_local.api.messages import Message
from omni_local.engine.kv_blocks import PAD_BLOCK
from omni_local.engine.attention import paged_attention
from omni_local.engine.cuda_graphs import attention_buckets
from omni_local.engine.kv_store import NO_PREFIX, GraphedKVWriter
from omni_local.prompts import build_prompt

TEXT = " ".join(f"Rule {i}: answer the sailor plainly." for i in range(6))


@torch.inference_mode()
def test_a_padded_first_prefill_through_a_graphs_writer_with_no_prefix_gives_the_eager_prefills_logits_and_rows(
    demo_settings,
):
    with OmniLocal(demo_settings.replace(prefix_cache=False, encoder_cache=False)) as app:
        runner = app.backend.engine.runner
        kv, size = runner.kv, runner.kv.shape.block_tokens
        prompt = build_prompt([Message("user", [TEXT])], runner.encoder.processor)
        prepared = runner.prepare(prompt, 0, remember=False)
        n = prompt.num_tokens
        padded = (n // size + 2) * size  # past the sequence's blocks: its padding goes to the pad block
        eager_table, graph_table = kv.take(kv.shape.blocks_for(n)), kv.take(kv.shape.blocks_for(n))
        expected = runner._prefill_step(kv.writer(eager_table, 0), prepared.embeds, prepared.positions)

        table = torch.tensor([[*graph_table, PAD_BLOCK, PAD_BLOCK]], device=runner.device)
        indices = torch.arange(padded, device=runner.device)[None]
        blocks = table.gather(1, indices // size)
        last = torch.tensor([n - 1], device=runner.device)
        cache = GraphedKVWriter(kv, table, indices, blocks, indices % size, last, NO_PREFIX)
        dense = runner._dense_input(prepared)
        dense = torch.cat([dense, dense.new_zeros((1, padded - n, dense.shape[-1]))], dim=1)
        positions = torch.cat([prepared.positions, prepared.positions[:, :, -1:].expand(-1, -1, padded - n)], dim=2)
        logits = runner._dense_prefill_step(cache, dense, positions)

        torch.testing.assert_close(logits, expected)
        for layer in kv.keys + kv.values:
            torch.testing.assert_close(rows(layer, graph_table, n), rows(layer, eager_table, n))


@torch.inference_mode()
def test_a_padded_tail_on_a_prefix_through_a_graphs_writer_with_the_kernel_gives_the_eager_prefills_logits_and_rows(
    demo_settings,
):
    with OmniLocal(demo_settings.replace(prefix_cache=False, encoder_cache=False)) as app:
        runner = app.backend.engine.runner
        kv, size = runner.kv, runner.kv.shape.block_tokens
        prompt = build_prompt([Message("user", [TEXT])], runner.encoder.processor)
        prepared = runner.prepare(prompt, 0, remember=False)
        n = prompt.num_tokens
        start, padded = n - 7, 16  # a 7-token tail padded to a graph's 16, past a block's end
        eager_table, graph_table = kv.take(kv.shape.blocks_for(n + padded)), kv.take(kv.shape.blocks_for(n + padded))
        head = prepared.rows(0, start)
        for table in (eager_table, graph_table):
            runner._prefill_step(kv.writer(table, 0), head.embeds, head.positions)
        tail = prepared.rows(start, n)
        expected = runner._prefill_step(kv.writer(eager_table, start), tail.embeds, tail.positions)

        bucket = next(r for r in attention_buckets(kv.shape.max_tokens) if r >= start + padded)
        table = torch.tensor([graph_table + [PAD_BLOCK] * (kv.shape.blocks_for(bucket) - len(graph_table))],
                             device=runner.device)
        indices = start + torch.arange(padded, device=runner.device)[None]
        blocks = table.gather(1, indices // size)
        last = torch.tensor([n - start - 1], device=runner.device)
        cache = GraphedKVWriter(kv, table, indices, blocks, indices % size, last, bucket, kernel=paged_attention)
        dense = runner._dense_input(tail)
        dense = torch.cat([dense, dense.new_zeros((1, padded - (n - start), dense.shape[-1]))], dim=1)
        positions = torch.cat([tail.positions, tail.positions[:, :, -1:].expand(-1, -1, padded - (n - start))], dim=2)
        logits = runner._dense_prefill_step(cache, dense, positions)

        torch.testing.assert_close(logits, expected)
        for layer in kv.keys + kv.values:
            torch.testing.assert_close(rows(layer, graph_table, n), rows(layer, eager_table, n))


def rows(layer: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """[kv_heads, n, head_dim]: the first n rows of the sequence in `table`'s blocks of a pool layer."""
    return layer[table].transpose(0, 1).flatten(1, 2)[:, :n]
