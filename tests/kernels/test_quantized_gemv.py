"""Our GEMV (kernels/gemv.py): a decode batch's few rows times an fp8 or int8 weight with one
scale a row, or an int4 one with a scale per group, against the rows times the dequantized weight. In Triton's CPU interpreter here (float32
and float16 rows: it multiplies bfloat16 wrongly), at shapes whose last tiles are ragged; compiled
for an H200 in bfloat16; and on a GPU (OMNI_LOCAL_TEST_DEVICE=cuda) at the Thinker's projection
shapes, in the quantized layers, eager, compiled and graphed."""

import pytest
import torch

from device_under_test import TEST_DEVICE
from omni_local.kernels.gemv_tiles import GemvTile
from omni_local.model.quantized import QuantizedLinear, dequantize, quantize
from omni_local.model.quantized.formats import Quantized

FORMATS = ["fp8", "int8", "int4"]
DTYPES = [torch.float32, torch.float16]
DTYPE_IDS = ["float32", "float16"]
OUT_FEATURES, IN_FEATURES = 40, 72  # with the tile below: three column tiles and three K steps, the last of each ragged
INT4_IN_FEATURES = 96  # int4's K is whole groups (of 32 here, one K step each): three steps, none ragged
# The two sums differ in order only; in float16 each is rounded once, so they may land one rounding apart.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}

interpreted = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")


def normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def stored(format: str, dtype: torch.dtype, out_features: int = OUT_FEATURES, in_features: int | None = None
           ) -> Quantized:
    """A weight as a QuantizedLinear holds it for a model in `dtype` (int8's and int4's scales in
    that dtype), of `in_features` inputs (default: the format's test width)."""
    weight = quantize(normal(out_features, in_features or width(format)), format)
    scales = weight.scales.to(dtype) if format in ("int8", "int4") else weight.scales
    return Quantized(format, weight.values, scales, weight.group)


def width(format: str) -> int:
    return INT4_IN_FEATURES if format == "int4" else IN_FEATURES


def expected(x: torch.Tensor, weight: Quantized) -> torch.Tensor:
    return (x.float() @ dequantize(weight, torch.float32).T).to(x.dtype)


def small_tile(split_k: int = 1) -> GemvTile:
    return GemvTile(block_m=16, block_n=16, block_k=32, split_k=split_k)


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("format", FORMATS)
def test_the_gemv_multiplies_rows_by_the_dequantized_weight(format, dtype, rows):
    from omni_local.kernels.gemv import gemv

    weight = stored(format, dtype)
    x = normal(rows, width(format), seed=rows).to(dtype)

    out = gemv(x, weight.values, weight.scales, small_tile())

    assert out.dtype == dtype
    torch.testing.assert_close(out, expected(x, weight), **TOLERANCE[dtype])


@interpreted
@pytest.mark.parametrize("rows", [3, 20])  # 20: two blocks of rows, the second ragged
@pytest.mark.parametrize("split_k", [2, 4])  # 4: K's three steps in splits of one step, the last split empty
@pytest.mark.parametrize("format", FORMATS)
def test_split_k_gives_the_rows_times_the_dequantized_weight_too(format, split_k, rows):
    from omni_local.kernels.gemv import gemv

    weight = stored(format, torch.float32)
    x = normal(rows, width(format), seed=rows)

    out = gemv(x, weight.values, weight.scales, small_tile(split_k))

    torch.testing.assert_close(out, expected(x, weight), **TOLERANCE[torch.float32])


@interpreted
@pytest.mark.parametrize("split_k", [1, 4])
def test_every_output_is_written_over_whatever_its_buffers_held(split_k):
    from omni_local.kernels.gemv import gemv_into

    weight = stored("int8", torch.float16)
    x = normal(17, IN_FEATURES, seed=5).half()  # a second block of rows with one real row
    out = torch.full((17, OUT_FEATURES), float("nan"), dtype=torch.float16)
    partials = torch.full((split_k, 17, OUT_FEATURES), float("nan")) if split_k > 1 else None

    gemv_into(out, x, weight.values, weight.scales, small_tile(split_k), partials)

    assert not out.isnan().any()
    torch.testing.assert_close(out, expected(x, weight), **TOLERANCE[torch.float16])


@interpreted
def test_a_rows_output_has_the_same_bits_alone_and_in_batches_of_any_size():
    # The tile comes from the weight's shape alone: each row's sums run in one order whatever the batch.
    # The interpreter's tl.dot adds each K step's whole product to the sums, so here this catches K
    # steps that change with the rows; on a GPU (below) a split or a BLOCK_M that does too.
    from omni_local.kernels.gemv import quantized_gemv

    weight = stored("fp8", torch.float32, out_features=48, in_features=300)  # three K steps of the default tile
    batch = normal(20, 300, seed=6)

    outs = [quantized_gemv(batch[:rows], weight.values, weight.scales) for rows in (1, 3, 16, 20)]

    assert all(torch.equal(out[0], outs[0][0]) for out in outs)
    assert torch.equal(outs[1][2], outs[3][2])


@interpreted
@pytest.mark.parametrize("split_k", [1, 4])
def test_an_unscaled_weight_in_the_rows_dtype_gives_any_rows_its_product_with_the_same_bits_in_any_batch(split_k):
    # invariant_matmul, the deterministic setting's dense product: a prefill's rows and a decode
    # step's go through one kernel and one tile.
    from omni_local.kernels.gemv import gemv

    weight = normal(OUT_FEATURES, IN_FEATURES, seed=8)
    batch = normal(37, IN_FEATURES, seed=9)  # three blocks of 16 rows, the last ragged

    outs = {rows: gemv(batch[:rows], weight, None, small_tile(split_k)) for rows in (1, 5, 16, 37)}

    torch.testing.assert_close(outs[37], batch @ weight.T, **TOLERANCE[torch.float32])
    assert all(torch.equal(out, outs[37][: len(out)]) for out in outs.values())


@interpreted
def test_the_ops_pass_torch_librarys_checks_of_their_fakes_and_schemas():
    from omni_local.kernels.gemv import invariant_matmul, quantized_gemv

    weight = stored("int8", torch.float16)  # its schema check compares tensors, which float8 ones refuse
    rows = normal(2, IN_FEATURES, seed=7).half()

    torch.library.opcheck(quantized_gemv, (rows, weight.values, weight.scales))
    torch.library.opcheck(invariant_matmul, (rows, normal(OUT_FEATURES, IN_FEATURES).half()))


def test_on_the_cpu_a_quantized_layer_keeps_the_librarys_matmuls():
    layer = QuantizedLinear.replacing(torch.nn.Linear(IN_FEATURES, OUT_FEATURES), "int8")

    assert not layer.gemv


COMPILE_GEMV_FOR_SM90 = """
from omni_local.kernels.gemv import _gemv_kernel
from omni_local.kernels.gemv_tiles import DEFAULT, TUNED
from omni_local.kernels.weight_tiles import INT4_GROUPS, PLAIN, ROW_SCALED

aligned = ("x_ptr", "weight_ptr", "scales_ptr", "out_ptr", "partials_ptr", "out_features", "in_features",
           "split_depth", "x_row_stride", "weight_row_stride", "scale_row_stride", "out_row_stride",
           "partial_split_stride")
tiles = dict(BLOCK_M=DEFAULT.block_m, BLOCK_N=DEFAULT.block_n, BLOCK_K=DEFAULT.block_k)
options = dict(num_warps=DEFAULT.num_warps, num_stages=DEFAULT.num_stages)
formats = (("*fp8e4nv", "*fp32", ROW_SCALED.value, 0), ("*i8", "*bf16", ROW_SCALED.value, 0),
           ("*u8", "*bf16", INT4_GROUPS.value, 128))

def pointers(weight, scales, rows="*bf16"):
    return dict(x_ptr=rows, weight_ptr=weight, scales_ptr=scales, out_ptr=rows, partials_ptr="*fp32",
                counters_ptr="*i32")

for weight, scales, format, group in formats:
    for split_k in (1, 4):  # 4: the partials summed by the last split to finish, counted in with an atomic
        kernel = compiled(_gemv_kernel, pointers(weight, scales),
                          dict(SPLIT_K=split_k, FORMAT=format, GROUP=group, DOT_PRECISION=None, **tiles), **options)
        assert ("atom.global" in kernel.asm["ptx"]) == (split_k > 1)
    # As launched at the projections' shapes: the loads pipelined through shared memory, which must fit
    # the 99 KiB a block of Ada, Ampere's sm86 and Blackwell's sm120 may take, float32 rows included.
    for rows, precision in (("*bf16", None), ("*fp32", "ieee")):
        kernel = compiled(_gemv_kernel, pointers(weight, scales, rows),
                          dict(SPLIT_K=1, FORMAT=format, GROUP=group, DOT_PRECISION=precision, **tiles), aligned,
                          **options)
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], "the loads are not pipelined"
        assert kernel.metadata.shared <= 99 << 10, (rows, kernel.metadata.shared)
# A bfloat16 weight, unscaled (invariant_matmul), and int4, at the H200's tuned tiles too.
for tile in (DEFAULT, *TUNED.values()):
    for weight, scales, format, group in (("*bf16", "*bf16", PLAIN.value, 0), formats[2]):
        for split_k in {tile.split_k, 4}:
            compiled(_gemv_kernel, pointers(weight, scales),
                     dict(SPLIT_K=split_k, FORMAT=format, GROUP=group, DOT_PRECISION=None, BLOCK_M=tile.block_m,
                          BLOCK_N=tile.block_n, BLOCK_K=min(tile.block_k, group or tile.block_k)), aligned,
                     num_warps=tile.num_warps, num_stages=tile.num_stages)
"""


def test_the_gemv_compiles_for_an_h200_its_default_tile_pipelined_within_any_gpus_shared_memory():
    from compile_for_h200 import compile_for_h200

    done = compile_for_h200(COMPILE_GEMV_FOR_SM90)

    assert done.returncode == 0, done.stderr


on_a_gpu = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")
# Qwen3-Omni-30B-A3B's Thinker: q_proj, k_proj (v_proj's shape), o_proj as (in, out).
THINKER_PROJECTIONS = [(2048, 4096), (2048, 512), (4096, 2048)]


@pytest.mark.cuda
@on_a_gpu
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", THINKER_PROJECTIONS, ids=["q", "kv", "o"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@torch.inference_mode()
def test_on_a_gpu_the_gemv_multiplies_bfloat16_rows_by_the_dequantized_weight(shape, format, rows):
    from omni_local.kernels.gemv import quantized_gemv

    in_features, out_features = shape
    generator = torch.Generator("cuda").manual_seed(rows)
    weight = quantize(torch.randn((out_features, in_features), device="cuda", generator=generator), format)
    scales = weight.scales.bfloat16() if format == "int8" else weight.scales
    x = torch.randn((rows, in_features), device="cuda", generator=generator)

    out = quantized_gemv(x.bfloat16(), weight.values, scales).float()

    # bfloat16 rows and one bfloat16 rounding of the output: well under 1% of the output's norm.
    reference = x.bfloat16().float() @ dequantize(Quantized(format, weight.values, scales, weight.group),
                                                  torch.float32).T
    assert ((out - reference).norm() / reference.norm()).item() <= 0.005


@pytest.mark.cuda
@on_a_gpu
@pytest.mark.parametrize("format", FORMATS)
@torch.inference_mode()
def test_on_a_gpu_a_quantized_layer_takes_the_gemv_for_a_decode_batch_compiled_and_graphed(format):
    from omni_local.engine.forward.cuda_graphs import capture_graph
    from omni_local.kernels.gemv import quantized_gemv
    from omni_local.model.quantized.linear import GEMV_MAX_ROWS

    linear = torch.nn.Linear(2048, 512, bias=False, device="cuda", dtype=torch.bfloat16)  # the Thinker's k_proj
    layer = QuantizedLinear.replacing(linear, format)
    # Each format's layer is a new module for Dynamo, compiled again on the same code object: forget
    # the earlier formats' compiles, or the third one passes Dynamo's limit of compiles.
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    assert layer.gemv
    for rows in (1, 5, GEMV_MAX_ROWS, 64):
        x = torch.randn((rows, 2048), device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(rows))
        eager = layer(x)
        if rows <= GEMV_MAX_ROWS:
            assert torch.equal(eager, quantized_gemv(x, layer.values, layer.scales)), rows
            graph, graphed = capture_graph(lambda x=x: compiled(x), torch.cuda.graph_pool_handle())
            graph.replay()
            assert torch.equal(graphed, eager), rows  # the op is left whole: the same kernel, the same bits
        else:
            torch.testing.assert_close(compiled(x), eager, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@on_a_gpu
@pytest.mark.parametrize("format", FORMATS)
@torch.inference_mode()
def test_on_a_gpu_a_rows_output_has_the_same_bits_alone_and_in_a_decode_batch(format):
    from omni_local.kernels.gemv import quantized_gemv

    generator = torch.Generator("cuda").manual_seed(8)
    weight = quantize(torch.randn((512, 2048), device="cuda", generator=generator), format)
    scales = weight.scales.bfloat16() if format == "int8" else weight.scales
    batch = torch.randn((16, 2048), device="cuda", generator=generator).bfloat16()

    outs = [quantized_gemv(batch[:rows], weight.values, scales) for rows in (1, 5, 16)]

    assert all(torch.equal(out[0], outs[0][0]) for out in outs)
    assert torch.equal(outs[1][4], outs[2][4])


@pytest.mark.cuda
@on_a_gpu
@pytest.mark.parametrize("format", ["fp8", "bf16"])
@torch.inference_mode()
def test_on_a_gpu_split_sums_added_by_the_last_split_to_finish_give_the_same_bits_every_launch_and_replay(format):
    # Whichever split of a tile finishes last adds them all, in split order: a race in counting them (a
    # sum before every part is written, or a counter left uncleared for the next launch) would show.
    from omni_local.engine.forward.cuda_graphs import capture_graph
    from omni_local.kernels.gemv import gemv

    generator = torch.Generator("cuda").manual_seed(9)
    weight = torch.randn((2048, 4096), device="cuda", generator=generator)  # o_proj's shape
    x = torch.randn((16, 4096), device="cuda", generator=generator).bfloat16()
    if format == "bf16":
        values, scales, dequantized = weight.bfloat16(), None, weight.bfloat16().float()
    else:
        stored = quantize(weight, format)
        values, scales, dequantized = stored.values, stored.scales, dequantize(stored, torch.float32)
    tile = GemvTile(block_n=32, block_k=128, split_k=8, num_stages=3)  # 64 tiles of 8 splits

    first = gemv(x, values, scales, tile)
    graph, graphed = capture_graph(lambda: gemv(x, values, scales, tile), torch.cuda.graph_pool_handle())

    reference = x.float() @ dequantized.T
    assert ((first.float() - reference).norm() / reference.norm()).item() <= 0.005
    assert all(torch.equal(gemv(x, values, scales, tile), first) for _ in range(200))
    for _ in range(50):
        graph.replay()
        assert torch.equal(graphed, first)
