"""Paged attention: our Triton kernel (in Triton's CPU interpreter on the CPU run; conftest.py sets
TRITON_INTERPRET=1) and the gathered reference against PyTorch's SDPA over the same KV laid out
contiguously, on tiny shapes; at the Thinker's full size in bfloat16 on the GPU run
(OMNI_LOCAL_TEST_DEVICE=cuda).

Every pool here holds NaN wherever no sequence's row is: in unused blocks, in the rows of a last
block past its sequence's end, and in the blocks the table lists past each sequence's end."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from compile_for_h200 import compile_for_h200
from omni_local.engine.memory.attention import gathered_attention
from omni_local.engine.memory.attention.reference import normed_and_rotated
from omni_local.kernels.attention import QueryNormRope
from omni_local.kernels.attention.paged import DECODE_SPLIT_ROWS, SPLIT_ROWS, paged_attention
from paged_kv import (
    CASES, FLOAT16, FLOAT32, HEAD_DIM, LONG_DECODE_ROWS, SCALING, PagedKV, case_inputs, full_size, new_tokens,
    on_cpu, on_gpu, paged_call, paged_kv,
)


def contiguous_sdpa(query: torch.Tensor, kv: PagedKV, query_rows: torch.Tensor) -> torch.Tensor:
    """Plain SDPA [B, L, heads, head_dim] over the contiguous KV, each new token masked to its rows."""
    rows = torch.arange(kv.keys.shape[2], device=query.device)
    allowed = rows[None, None, None, :] <= query_rows[:, None, :, None]
    out = F.scaled_dot_product_attention(query, kv.keys, kv.values, attn_mask=allowed, scale=SCALING,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def paged_kv_in_float32(kv: PagedKV) -> PagedKV:
    """The contiguous KV in float32: the oracle's, whatever the pools' dtype."""
    return PagedKV(kv.keys.float(), kv.values.float(), kv.key_pool, kv.value_pool, kv.block_tables)


@on_cpu
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_and_the_gathered_reference_give_sdpa_over_contiguous_kv(case, dtype, batch_invariant):
    query, query_rows, kv = case_inputs(case, dtype)
    expected = contiguous_sdpa(query.float(), paged_kv_in_float32(kv), query_rows)
    tolerance = FLOAT32 if dtype == torch.float32 else FLOAT16

    ours = paged_call(paged_attention, query, kv, query_rows, batch_invariant=batch_invariant)
    reference = paged_call(gathered_attention, query, kv, query_rows)

    assert ours.dtype == dtype and ours.shape == expected.shape
    torch.testing.assert_close(ours.float(), expected, **tolerance)
    torch.testing.assert_close(reference.float(), expected, **tolerance)


@on_cpu
@pytest.mark.parametrize("case", ["decode tokens of sequences of uneven lengths",
                                  "causal tails of new tokens on cached prefixes, one empty",
                                  "a short tail on a prefix longer than a split, beside a tail in one split"])
def test_nan_in_rows_no_query_may_read_never_reaches_the_output(case):
    query, query_rows, poisoned = case_inputs(case, torch.float32)
    _, _, clean = case_inputs(case, torch.float32, filler=0.0)

    ours = paged_call(paged_attention, query, poisoned, query_rows)
    reference = paged_call(gathered_attention, query, poisoned, query_rows)

    assert torch.isnan(poisoned.key_pool).any() and torch.isnan(poisoned.value_pool).any()
    assert torch.equal(ours, paged_call(paged_attention, query, clean, query_rows))
    assert torch.equal(reference, paged_call(gathered_attention, query, clean, query_rows))
    assert ours.isfinite().all() and reference.isfinite().all()


def query_norm_rope(query: torch.Tensor, shared_rotary: bool = False) -> QueryNormRope:
    """A q_norm's weight and eps and a rotary embedding's cos and sin [B, L, head_dim] for `query`
    [B, heads, L, head_dim] (with `shared_rotary`, [1, L, head_dim] for every sequence)."""
    batch, _, length, head_dim = query.shape
    generator = torch.Generator().manual_seed(2)
    weight = 1 + torch.rand(head_dim, generator=generator)
    angles = torch.rand((1 if shared_rotary else batch, length, head_dim // 2), generator=generator) * 6.3
    angles = torch.cat((angles, angles), dim=-1)  # rotary's pairs (d, d + head_dim / 2) share an angle
    return QueryNormRope(weight.to(query.dtype), 1e-6, angles.cos().to(query.dtype), angles.sin().to(query.dtype))


@on_cpu
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", ["decode tokens of sequences of uneven lengths",
                                  "a group of 3 query heads per kv head, not a power of two",
                                  "a decode token whose rows need longer splits than the fewest, beside a short one",
                                  "a short tail on a prefix longer than a split, beside a tail in one split",
                                  "a tail of two query tiles in the Thinker's group of 8"])
def test_the_kernel_norms_and_rotates_the_projections_queries_as_the_layer_would(case, dtype, batch_invariant):
    raw, query_rows, kv = case_inputs(case, dtype)
    norm_rope = query_norm_rope(raw)
    prepared = normed_and_rotated(raw, norm_rope)  # transformers' q_norm and apply_rotary_pos_emb, restated
    tolerance = FLOAT32 if dtype == torch.float32 else FLOAT16

    ours = paged_call(paged_attention, raw, kv, query_rows, batch_invariant=batch_invariant, norm_rope=norm_rope)
    reference = paged_call(gathered_attention, raw, kv, query_rows, norm_rope=norm_rope)

    expected = paged_call(paged_attention, prepared, kv, query_rows, batch_invariant=batch_invariant)
    torch.testing.assert_close(ours, expected, **tolerance)
    torch.testing.assert_close(reference, paged_call(gathered_attention, prepared, kv, query_rows))
    assert not torch.allclose(ours, paged_call(paged_attention, raw, kv, query_rows), **tolerance)


@on_cpu
def test_one_rotary_embedding_serves_a_whole_batch_as_transformers_broadcasts_it():
    raw, query_rows, kv = case_inputs("decode tokens of sequences of uneven lengths", torch.float32)
    shared = query_norm_rope(raw, shared_rotary=True)
    per_sequence = QueryNormRope(shared.weight, shared.eps, *(t.expand(raw.shape[0], -1, -1).contiguous()
                                                               for t in (shared.cos, shared.sin)))

    assert torch.equal(paged_call(paged_attention, raw, kv, query_rows, norm_rope=shared),
                       paged_call(paged_attention, raw, kv, query_rows, norm_rope=per_sequence))


def test_the_reference_norm_and_rotation_is_transformers_own():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (Qwen3OmniMoeThinkerTextRMSNorm,
                                                                            apply_rotary_pos_emb)

    raw, _ = new_tokens(4, [[3, 4, 5]], torch.bfloat16)
    norm_rope = query_norm_rope(raw)
    q_norm = Qwen3OmniMoeThinkerTextRMSNorm(HEAD_DIM, eps=norm_rope.eps).to(torch.bfloat16)
    q_norm.weight.data.copy_(norm_rope.weight)

    theirs, _ = apply_rotary_pos_emb(q_norm(raw.transpose(1, 2)).transpose(1, 2), raw, norm_rope.cos, norm_rope.sin)

    assert torch.equal(normed_and_rotated(raw, norm_rope), theirs)


@on_cpu
def test_the_kernel_reads_int32_and_int64_block_tables_alike():
    case = "sequences on both sides of a split boundary"
    query, query_rows, narrow = case_inputs(case, torch.float32, table_dtype=torch.int32)
    _, _, wide = case_inputs(case, torch.float32, table_dtype=torch.int64)
    assert narrow.block_tables.dtype == torch.int32 and wide.block_tables.dtype == torch.int64

    assert torch.equal(paged_call(paged_attention, query, narrow, query_rows),
                       paged_call(paged_attention, query, wide, query_rows))


@on_cpu
@pytest.mark.parametrize("split_rows", [128, 256])
def test_a_decode_step_split_in_longer_runs_gives_the_same_attention(split_rows):
    # What bench.paged_attention --split-rows times: other splits of the KV walk, merged in order.
    query, query_rows, kv = case_inputs("sequences on both sides of a split boundary", torch.float32)
    expected = contiguous_sdpa(query, paged_kv_in_float32(kv), query_rows)

    ours = paged_call(paged_attention, query, kv, query_rows, decode_split_rows=split_rows)

    torch.testing.assert_close(ours, expected, **FLOAT32)


# Tokens on both sides of split boundaries (SPLIT_ROWS), in a sequence of three splits' rows.
INVARIANT_ROWS = 2 * SPLIT_ROWS + 40
WATCHED = [0, 17, SPLIT_ROWS - 1, SPLIT_ROWS, SPLIT_ROWS + 1, 2 * SPLIT_ROWS + 7, INVARIANT_ROWS - 1]


def every_way_a_token_is_attended(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch-invariant kernel's output [len(WATCHED), heads, head_dim] for the WATCHED tokens of
    one sequence, computed as a decode step each, in a batch beside other sequences, in a table wider
    than the sequence (a graph's bucket), as a whole prefill, and as tails on cached prefixes of
    several lengths (each tail's queries all of the rows after its prefix)."""
    heads, kv_heads = 8, 2
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn((heads, INVARIANT_ROWS, HEAD_DIM), generator=generator).to(dtype)  # row t's query
    kv = paged_kv([INVARIANT_ROWS, 100, 3 * SPLIT_ROWS], kv_heads, dtype)
    ours = dict(batch_invariant=True)

    def attended(rows: list[int], sequences: slice = slice(0, 1), width: int | None = None) -> torch.Tensor:
        query = queries[:, rows][None].expand(sequences.stop - sequences.start, -1, -1, -1).contiguous()
        query_rows = torch.tensor([rows] * query.shape[0])
        query_rows[1:] = query_rows[1:].clamp(max=99)  # the other sequences' own rows
        table = kv.block_tables[sequences]
        if width:
            table = torch.cat([table, table[:, -1:].expand(-1, width - table.shape[1])], dim=1)
        out = paged_attention(query, kv.key_pool, kv.value_pool, table.contiguous(), query_rows, SCALING, **ours)
        return out[0]  # [L, heads, head_dim] of the watched sequence

    ways = {
        "decode steps": torch.stack([attended([t])[0] for t in WATCHED]),
        "decode steps beside two other sequences": torch.stack([attended([t], slice(0, 3))[0] for t in WATCHED]),
        "decode steps in a wider table": torch.stack([attended([t], width=kv.block_tables.shape[1] + 9)[0]
                                                      for t in WATCHED]),
    }
    for start in (0, 5, SPLIT_ROWS - 3, SPLIT_ROWS):  # the watched tokens before `start` decoded
        tail_rows = list(range(start, INVARIANT_ROWS))
        out = attended(tail_rows)
        ways[f"a tail after {start} cached rows"] = torch.stack(
            [out[tail_rows.index(t)] if t >= start else attended([t])[0] for t in WATCHED])
    return ways


@on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_batch_invariant_attention_gives_a_token_the_same_bits_however_it_is_computed(dtype):
    ways = every_way_a_token_is_attended(dtype)

    first, *others = ways
    for way in others:
        assert torch.equal(ways[way], ways[first]), f"{way} differs from {first}"


@on_cpu
def test_a_decode_steps_splits_follow_its_own_rows_so_it_gets_the_same_bits_beside_others_and_in_wider_tables():
    # Its splits are chosen from its own rows, never from the batch or the graph's bucket of rows.
    heads, kv_heads = 8, 2
    kv = paged_kv([LONG_DECODE_ROWS, 100, 3 * SPLIT_ROWS], kv_heads, torch.float32)
    generator = torch.Generator().manual_seed(3)
    watched = [5, DECODE_SPLIT_ROWS, 2 * SPLIT_ROWS + 7, LONG_DECODE_ROWS - 1]
    query = torch.randn((1, heads, 1, HEAD_DIM), generator=generator)

    def attended(last: int, sequences: int = 1, width: int | None = None) -> torch.Tensor:
        query_rows = torch.tensor([[last], [99], [3 * SPLIT_ROWS - 1]][:sequences])
        table = kv.block_tables[:sequences]
        if width:
            table = torch.cat([table, table[:, -1:].expand(-1, width - table.shape[1])], dim=1)
        queries = query.expand(sequences, -1, -1, -1).contiguous()
        return paged_attention(queries, kv.key_pool, kv.value_pool, table.contiguous(), query_rows, SCALING)[0]

    for last in watched:
        alone = attended(last)
        assert torch.equal(attended(last, sequences=3), alone), f"row {last} beside other sequences"
        assert torch.equal(attended(last, width=kv.block_tables.shape[1] + 70), alone), f"row {last} in a wider table"


@on_cpu
def test_padded_queries_repeating_a_row_get_that_rows_output():
    query, query_rows, kv = case_inputs("a tail padded by repeating its last row, as a CUDA graph pads it",
                                        torch.float32)
    query[:, :, 3:] = query[:, :, 2:3]  # the padding repeats the last real token too

    ours = paged_call(paged_attention, query, kv, query_rows)

    assert torch.equal(ours[:, 3], ours[:, 2]) and torch.equal(ours[:, 4], ours[:, 2])


@on_cpu
@pytest.mark.parametrize("rows", [[[31]], [[16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]],
                         ids=["a decode token", "a tail on a cached prefix"])
def test_gathered_attention_over_just_the_sequences_blocks_is_transformers_sdpa_bit_for_bit(rows):
    # Two blocks of 16 rows hold the 32 rows exactly; the table is wider, its other blocks NaN.
    query, query_rows = new_tokens(8, rows, torch.float32)
    kv = paged_kv([32], kv_heads=2, dtype=torch.float32, width=5)
    allowed = torch.arange(32)[None, None, None, :] <= query_rows[:, None, :, None]
    module = SimpleNamespace(num_key_value_groups=4, is_causal=True)
    expected, _ = sdpa_attention_forward(module, query, kv.keys[:, :, :32], kv.values[:, :, :32], allowed,
                                         scaling=SCALING)

    ours = paged_call(gathered_attention, query, kv, query_rows, blocks=2)

    assert torch.equal(ours, expected)


@on_cpu
def test_pools_of_different_layouts_are_refused():
    query, query_rows, kv = case_inputs("one decode token, its sequence shorter than a block", torch.float32)

    with pytest.raises(ValueError, match="one shape and one layout"):
        paged_attention(query, kv.key_pool, kv.value_pool.transpose(0, 1).contiguous().transpose(0, 1),
                        kv.block_tables, query_rows, SCALING)


# bfloat16 at the Thinker's group of 8 and head_dim 128: a decode step's split kernel, merged by its
# last split (its splits from its own rows), a short tail's split the same way, and a long tail's
# kernel; each also batch-invariant (a tail's splits in its program, no fused multiply-adds), and
# each with the queries normed and rotated as it loads them.
COMPILE_FOR_SM90 = """
from omni_local.kernels.attention.paged import _attention_kernel, query_tile

for invariant in (False, True):
    for length, table, partial in ((1, "*i32", True), (8, "*i64", not invariant), (64, "*i64", False)):
        for norm_rope, fp8 in ((False, False), (True, False), (True, True)):  # fp8: kv_dtype = "fp8"'s pools
            block_l, block_g = query_tile(8, length, invariant)
            pool = "*fp8e4nv" if fp8 else "*bf16"
            pointers = dict(q_ptr="*bf16", k_ptr=pool, v_ptr=pool, k_scales_ptr="*fp32", v_scales_ptr="*fp32",
                            table_ptr=table, rows_ptr="*i64", out_ptr="*bf16", acc_ptr="*fp32", stats_ptr="*fp32",
                            counters_ptr="*i32", norm_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", scale="fp32",
                            eps="fp32")
            kernel = compiled(_attention_kernel, pointers, dict(
                GROUP=8, BLOCK_G=block_g, BLOCK_L=block_l, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64,
                PARTIAL=partial, SPLIT_LOOP=invariant and length > 1, QUERY_SPLITS=length == 1 and not invariant,
                NORM_ROPE=norm_rope, FP8_KV=fp8, DOT_PRECISION=None), num_warps=4, num_stages=2,
                enable_fp_fusion=not invariant)
            assert ("atom.global" in kernel.asm["ptx"]) == partial
            assert ("rsqrt" in kernel.asm["ptx"]) == norm_rope
"""


@on_cpu
def test_the_kernels_compile_for_an_h200_without_a_gpu():
    done = compile_for_h200(COMPILE_FOR_SM90)

    assert done.returncode == 0, done.stderr


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("context", [256, 4096])
@torch.inference_mode()
def test_the_kernel_at_full_size_in_bfloat16_matches_the_reference(batch, context):
    assert_close_in_bfloat16(*full_size(batch, context))


@pytest.mark.cuda
@on_gpu
@torch.inference_mode()
def test_a_tail_on_a_cached_prefix_at_full_size_in_bfloat16_matches_the_reference():
    assert_close_in_bfloat16(*full_size(2, 1024, length=100))


def assert_close_in_bfloat16(query: torch.Tensor, query_rows: torch.Tensor, kv: PagedKV) -> None:
    """The kernel's output within bfloat16 rounding of the float32 computation, at worst off by twice
    as much as the reference's own bfloat16 SDPA."""
    exact = gathered_attention(query.float(), kv.key_pool.float(), kv.value_pool.float(), kv.block_tables,
                               query_rows, SCALING)
    theirs = paged_call(gathered_attention, query, kv, query_rows).float()

    ours = paged_call(paged_attention, query, kv, query_rows).float()

    # One bfloat16 rounding is 0.4% of a value; SDPA's bfloat16 kernel rounds its weights as ours does.
    assert ((ours - exact).norm() / exact.norm()).item() <= 0.01
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


@pytest.mark.cuda
@on_gpu
@torch.inference_mode()
def test_the_kernel_replays_in_a_cuda_graph_with_the_eager_result():
    query, query_rows, kv = full_size(16, 1024)

    def run() -> torch.Tensor:
        return paged_call(paged_attention, query, kv, query_rows)

    run()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    query.copy_(torch.randn_like(query))
    query_rows.copy_(torch.randint(0, 800, query_rows.shape, device="cuda"))  # within every sequence
    graph.replay()

    assert torch.equal(captured, run())


@pytest.mark.cuda
@on_gpu
@pytest.mark.parametrize("length", [1, 27], ids=["a decode step", "a short tail"])
@torch.inference_mode()
def test_splits_merged_by_the_last_to_finish_give_the_same_bits_every_launch(length):
    # Whichever of a tile's splits finishes last merges them all, in split order: a race in counting
    # them (a merge before every part is written, or a counter left uncleared) would show in some launch.
    query, query_rows, kv = full_size(16, 4096, length)
    first = paged_call(paged_attention, query, kv, query_rows)

    assert all(torch.equal(paged_call(paged_attention, query, kv, query_rows), first) for _ in range(200))
