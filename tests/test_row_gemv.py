"""The row GEMV (engine/dense/row_gemv.py): each row of a decode batch times an fp8 or int8 weight
(a scale a row), an int4 one (a scale a group) or one in the rows' dtype, without tl.dot, against
the rows times the dequantized weight. In Triton's CPU interpreter here, at shapes whose last tile
is ragged; compiled for an H200; and on a GPU (OMNI_LOCAL_TEST_DEVICE=cuda) at the Thinker's shapes."""

import pytest
import torch

from compile_for_h200 import compile_for_h200
from conftest import TEST_DEVICE
from omni_local.engine.dense.row_gemv import RowTile
from omni_local.model.quantized import dequantize, quantize
from omni_local.model.quantized.formats import Quantized

FORMATS = ["fp8", "int8", "int4", "bf16"]  # bf16: a weight in the rows' own dtype, no scales
OUT_FEATURES, IN_FEATURES = 40, 256  # three tiles of 16 rows, the last ragged; four steps of 64 inputs

interpreted = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")
on_a_gpu = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")


def normal(*shape: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def weight_and_reference(format: str, weight: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(values, scales, the float32 weight they stand for) of `weight` in `format` as a model in
    `dtype` holds it (int8's and int4's scales in that dtype)."""
    if format == "bf16":
        values = weight.to(dtype)
        return values, None, values.float()
    stored = quantize(weight, format)
    if format != "fp8":
        stored = Quantized(format, stored.values, stored.scales.to(dtype), stored.group)
    return stored.values, stored.scales, dequantize(stored, torch.float32)


@interpreted
@pytest.mark.parametrize("split_k", [1, 3])  # 3: four steps in splits of two, two and none
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("format", FORMATS)
def test_the_row_gemv_multiplies_each_row_by_the_dequantized_weight(format, rows, split_k):
    from omni_local.engine.dense.row_gemv import row_gemv

    values, scales, exact = weight_and_reference(format, normal(OUT_FEATURES, IN_FEATURES), torch.float32)
    x = normal(rows, IN_FEATURES, seed=rows)

    out = row_gemv(x, values, scales, RowTile(block_n=16, most_inputs_a_step=64, num_warps=4, split_k=split_k))

    torch.testing.assert_close(out, x @ exact.T, rtol=1e-5, atol=1e-5)


@interpreted
def test_a_rows_output_has_the_same_bits_alone_and_in_a_batch():
    from omni_local.engine.dense.row_gemv import row_gemv

    values, scales, _ = weight_and_reference("int4", normal(OUT_FEATURES, IN_FEATURES), torch.float32)
    batch = normal(7, IN_FEATURES, seed=3)
    tile = RowTile(block_n=16, most_inputs_a_step=64, num_warps=4, split_k=2)

    outs = [row_gemv(batch[:rows], values, scales, tile) for rows in (1, 3, 7)]

    assert all(torch.equal(out, outs[-1][: len(out)]) for out in outs)


COMPILE_ROW_GEMV_FOR_SM90 = """
from omni_local.engine.dense.row_gemv import DEFAULT, _row_gemv_kernel
from omni_local.engine.weight_tiles import INT4_GROUPS, PLAIN, ROW_SCALED, row_steps

for weight, scales, format, group, value_bytes in (("*fp8e4nv", "*fp32", ROW_SCALED.value, 0, 1),
                                                    ("*i8", "*bf16", ROW_SCALED.value, 0, 1),
                                                    ("*u8", "*bf16", INT4_GROUPS.value, 128, 1),
                                                    ("*bf16", "*bf16", PLAIN.value, 0, 2)):
    for split_k in (1, 4):  # 4: the partial sums added by the last split to finish, counted in with an atomic
        kernel = compiled(_row_gemv_kernel, dict(x_ptr="*bf16", weight_ptr=weight, scales_ptr=scales, out_ptr="*bf16",
                                                 partials_ptr="*fp32", counters_ptr="*i32"),
                          dict(BLOCK_N=DEFAULT.block_n, SPLIT_K=split_k,
                               **row_steps(format, group, 2048, value_bytes, DEFAULT.most_inputs_a_step)),
                          num_warps=DEFAULT.num_warps)
        assert ("atom.global" in kernel.asm["ptx"]) == (split_k > 1)
"""


def test_the_row_gemv_compiles_for_an_h200_in_every_format():
    done = compile_for_h200(COMPILE_ROW_GEMV_FOR_SM90)

    assert done.returncode == 0, done.stderr


# Qwen3-Omni-30B-A3B's Thinker as (in, out): the fused qkv_proj, o_proj, the router's gate.
THINKER_SHAPES = [(2048, 5120), (4096, 2048), (2048, 128)]


@pytest.mark.cuda
@on_a_gpu
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", THINKER_SHAPES, ids=["qkv", "o", "router"])
@torch.inference_mode()
def test_on_a_gpu_the_row_gemv_multiplies_bfloat16_rows_by_the_dequantized_weight_with_the_same_bits_in_any_batch(
    shape, format
):
    from omni_local.engine.dense.row_gemv import row_gemv

    in_features, out_features = shape
    values, scales, exact = weight_and_reference(format, normal(out_features, in_features, device="cuda"),
                                                 torch.bfloat16)
    batch = normal(16, in_features, seed=4, device="cuda").bfloat16()

    outs = [row_gemv(batch[:rows], values, scales) for rows in (1, 5, 16)]

    reference = batch.float() @ exact.T
    assert ((outs[-1].float() - reference).norm() / reference.norm()).item() <= 0.005
    assert all(torch.equal(out, outs[-1][: len(out)]) for out in outs)


@pytest.mark.cuda
@on_a_gpu
@torch.inference_mode()
def test_on_a_gpu_split_sums_added_by_the_last_split_to_finish_give_the_same_bits_every_launch_and_replay():
    from omni_local.engine.cuda_graphs import capture_graph
    from omni_local.engine.dense.row_gemv import row_gemv

    stored = quantize(normal(2048, 4096, device="cuda"), "int8")  # o_proj's shape
    x = normal(16, 4096, seed=5, device="cuda").bfloat16()
    tile = RowTile(block_n=16, most_inputs_a_step=512, num_warps=4, split_k=4)

    first = row_gemv(x, stored.values, stored.scales, tile)
    graph, graphed = capture_graph(lambda: row_gemv(x, stored.values, stored.scales, tile),
                                   torch.cuda.graph_pool_handle())

    assert all(torch.equal(row_gemv(x, stored.values, stored.scales, tile), first) for _ in range(200))
    for _ in range(50):
        graph.replay()
        assert torch.equal(graphed, first)
