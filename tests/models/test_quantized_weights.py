"""Quantized weights (model/quantized/): the formats' arithmetic, the quantized layers that take the
place of transformers' own, and our MoE kernels reading fp8 and int4 experts, against the
dequantized weights through transformers' own experts loop. Kernels run in Triton's CPU interpreter
here (float32 and float16); tests/kernels/test_moe_on_gpu.py runs them at full size on a GPU."""

import pytest
import torch
import triton
import triton.language as tl

from device_under_test import TEST_DEVICE
from moe_cases import ROUTES, experts, logits_choosing, router_over_logits, text_config
from omni_local.model.quantized import (QuantizedEmbedding, QuantizedExperts, QuantizedLinear, Quantized, dequantize,
                                        quantize)
from omni_local.model.quantized import linear as linear_module
from omni_local.kernels.weight_tiles import int4_nibbles
from omni_local.model.quantized.formats import int4_values

HIDDEN, INTERMEDIATE = 64, 32  # int4 groups of 64 and 32 inputs
FORMATS = ["fp8", "int4"]
# A weight drawn from a normal distribution, back from each format: relative error of the whole matrix.
ROUND_TRIP_ERROR = {"fp8": 0.035, "int8": 0.01, "int4": 0.13}


def normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("format", ["fp8", "int8", "int4"])
def test_a_weight_comes_back_from_each_format_within_its_rounding(format):
    weight = normal(96, 256)

    back = dequantize(quantize(weight, format), torch.float32)

    assert (back - weight).norm() / weight.norm() < ROUND_TRIP_ERROR[format]


def test_int4_packs_two_values_a_byte_the_even_one_low_each_plus_8_with_a_scale_per_group_of_128():
    row = torch.arange(256, dtype=torch.float32) % 15 - 7  # -7 .. 7, repeating: each group's largest is 7
    weight = torch.stack([row * 0.5, row * 0.25])

    stored = quantize(weight, "int4")

    assert stored.values.shape == (2, 128) and stored.values.dtype == torch.uint8
    assert stored.values[0, 0].item() == (-7 + 8) | ((-6 + 8) << 4)
    assert torch.equal(stored.scales, torch.tensor([[0.5, 0.5], [0.25, 0.25]]))
    assert torch.equal(int4_values(stored.values)[0].float(), row)
    assert torch.equal(dequantize(stored, torch.float32), weight)


@triton.jit
def _unpacked_kernel(packed_ptr, low_ptr, high_ptr, BYTES: tl.constexpr):
    at = tl.arange(0, BYTES)
    low, high = int4_nibbles(tl.load(packed_ptr + at))
    tl.store(low_ptr + at, low)
    tl.store(high_ptr + at, high)


def test_the_kernels_unpack_every_int4_byte_to_its_two_values_exactly():
    # Compiled, the unpacking is PTX (four bytes a register, each nibble's place its own constant);
    # in the interpreter, Triton's operations: both must give every byte's values, wherever it lies.
    device = "cuda" if TEST_DEVICE == "cuda" else "cpu"
    packed = torch.arange(256, dtype=torch.uint8, device=device).roll(37)
    low, high = torch.empty(256, device=device), torch.empty(256, device=device)

    _unpacked_kernel[(1,)](packed, low, high, BYTES=256, num_warps=2)

    assert torch.equal(low, (packed & 0xF).float() - 8) and torch.equal(high, (packed >> 4).float() - 8)


@pytest.mark.parametrize("format", ["fp8", "int8", "int4"])
def test_a_quantized_linear_layer_multiplies_by_its_dequantized_weight(format):
    linear = torch.nn.Linear(64, 48, bias=True)
    x = normal(3, 5, 64, seed=1)

    layer = QuantizedLinear.replacing(linear, format)

    expected = x @ dequantize(layer.weight, torch.float32).T + linear.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_a_quantized_embedding_gives_its_dequantized_tables_rows_in_the_models_dtype():
    embedding = torch.nn.Embedding(40, 64, dtype=torch.bfloat16)
    ids = torch.tensor([[3, 0, 39], [3, 7, 7]])

    table = QuantizedEmbedding.replacing(embedding, "int8")

    assert table.values.dtype == torch.int8 and table.scales.shape == (40,) and table.scales.dtype == torch.bfloat16
    rows = table(ids)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, dequantize(Quantized("int8", table.values, table.scales), torch.bfloat16)[ids])
    assert torch.equal(table(torch.tensor(7)), rows[1, 1])  # a single id, as transformers looks up special tokens


def test_an_encoders_quantized_linear_never_takes_the_gemv_where_a_decoders_would(monkeypatch):
    monkeypatch.setattr(linear_module, "runs_gemv", lambda device, format, group: True)
    linear = torch.nn.Linear(64, 48)

    assert QuantizedLinear.replacing(linear, "int8").gemv
    assert not QuantizedLinear.replacing(linear, "int8", batched=True).gemv


def test_an_int4_dense_layer_takes_the_gemv_on_a_gpu_where_it_reads_its_groups(monkeypatch):
    # A W4A16 checkpoint's attention projections (groups of 128): the GEMV reads their nibbles in place.
    monkeypatch.setattr(linear_module, "triton_refusal", lambda device: None)  # a GPU that runs our kernels

    assert linear_module.runs_gemv(torch.device("cuda"), "int4", group=128)
    assert not linear_module.runs_gemv(torch.device("cuda"), "int4", group=16)  # dequantized, as on the CPU
    assert not linear_module.runs_gemv(torch.device("cpu"), "int4", group=128)


@pytest.mark.parametrize("format", FORMATS)
def test_experts_quantized_one_projection_at_a_time_equal_experts_quantized_whole(format):
    module = experts(text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE), torch.float32)
    whole = QuantizedExperts.replacing(module, format)

    by_parts = QuantizedExperts(4, HIDDEN, INTERMEDIATE, module.act_fn, format)
    for expert in range(4):
        gate, up = module.gate_up_proj[expert].detach().chunk(2)
        by_parts.take_expert_weight(expert, "up_proj", up)  # in any order
        by_parts.take_expert_weight(expert, "down_proj", module.down_proj[expert].detach())
        by_parts.take_expert_weight(expert, "gate_proj", gate)

    for name, buffer in whole.named_buffers():
        assert torch.equal(buffer, by_parts.get_buffer(name)), name
    assert torch.equal(whole.gate_up.values, quantize(module.gate_up_proj.detach(), format).values)


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_experts_run_transformers_loop_over_their_dequantized_weights(format):
    config = text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE)
    module = experts(config, torch.float32)
    quantized = QuantizedExperts.replacing(module, format)
    with torch.no_grad():
        module.gate_up_proj.copy_(dequantize(quantized.gate_up, torch.float32))
        module.down_proj.copy_(dequantize(quantized.down, torch.float32))
    hidden = normal(6, HIDDEN, seed=2)
    _, weights, chosen = router_over_logits(config)(normal(6, 4, seed=3))

    torch.testing.assert_close(quantized(hidden, chosen, weights), module(hidden, chosen, weights))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", ROUTES)
def test_the_expert_kernels_read_quantized_experts_as_their_dequantized_weights(case, format, dtype):
    from omni_local.kernels.moe.routed_experts import weighted_expert_rows
    from omni_local.kernels.moe.tile_configs import GemmTile, TileConfig

    config = text_config(num_experts=4, top_k=2, hidden=HIDDEN, intermediate=INTERMEDIATE)
    quantized = QuantizedExperts.replacing(experts(config, torch.float32), format)
    logits = logits_choosing(ROUTES[case], num_experts=4)
    hidden = normal(len(logits), HIDDEN, seed=4).to(dtype)
    _, weights, chosen = router_over_logits(config)(logits)
    expected = quantized(hidden.float(), chosen, weights).to(dtype)

    tiles = TileConfig(16, GemmTile(16, 32), GemmTile(16, 32))  # BLOCK_K 32: int4's down groups hold one tile
    rows = weighted_expert_rows(hidden, logits.to(dtype), quantized.gate_up_values, quantized.down_values, top_k=2,
                                renormalize=True, config=tiles, gate_up_scales=quantized.gate_up_scales,
                                down_scales=quantized.down_scales)

    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-3)
    torch.testing.assert_close(rows.sum(dim=1).to(dtype), expected, **tolerance)


# A decode step's sizes for the kernels by pair: 4 groups of 128 inputs into gate_up, 3 groups of 64
# into down, column tiles with ragged ends.
PAIR_HIDDEN, PAIR_INTERMEDIATE = 512, 192


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")
@pytest.mark.parametrize("steps", [(512, 64), (128, 64)], ids=["the whole row a step", "a group a step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", ["one token routed to its top-k", "an expert gets no token"])
@pytest.mark.parametrize("weights", ["int4", "fp8"])
def test_a_decode_steps_quantized_experts_run_by_pair_as_their_dequantized_weights(weights, case, dtype, steps,
                                                                                   monkeypatch):
    from omni_local.kernels.moe import routed_experts as routed
    from omni_local.kernels.moe import pairs

    monkeypatch.setitem(pairs.GATE_UP_TILES, weights, pairs.PairTile(16, steps[0], 4))
    monkeypatch.setitem(pairs.DOWN_TILES, weights, pairs.PairTile(32, steps[0], 4))
    config = text_config(num_experts=4, top_k=2, hidden=PAIR_HIDDEN, intermediate=PAIR_INTERMEDIATE)
    quantized = QuantizedExperts.replacing(experts(config, torch.float32), weights)
    gate_up = routed.kernel_weight(quantized.gate_up_values, quantized.gate_up_scales)
    down = routed.kernel_weight(quantized.down_values, quantized.down_scales)
    assert (pairs._steps(gate_up, pairs.GATE_UP_TILES[weights])["STEP"],
            pairs._steps(down, pairs.DOWN_TILES[weights])["STEP"]) == steps
    logits = logits_choosing(ROUTES[case], num_experts=4)
    hidden = normal(len(logits), PAIR_HIDDEN, seed=5).to(dtype)
    _, routing, chosen = router_over_logits(config)(logits)
    expected = quantized(hidden.float(), chosen, routing).to(dtype)
    monkeypatch.setattr(routed, "gate_up_silu", None)  # the sorted blocks' kernels are not called

    rows = routed.weighted_expert_rows(hidden, logits.to(dtype), quantized.gate_up_values, quantized.down_values,
                                       top_k=2, renormalize=True, gate_up_scales=quantized.gate_up_scales,
                                       down_scales=quantized.down_scales)

    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-3)
    torch.testing.assert_close(rows.sum(dim=1).to(dtype), expected, **tolerance)


COMPILE_GEMMS_FOR_SM90 = """
from omni_local.kernels.moe.down import _down_kernel
from omni_local.kernels.moe.gate_up import _gate_up_kernel
from omni_local.kernels.moe.pairs import _down_pairs_kernel, _gate_up_pairs_kernel
from omni_local.kernels.weight_tiles import INT4_GROUPS, PLAIN, ROW_SCALED

weights = {PLAIN.value: "*bf16", ROW_SCALED.value: "*fp8e4nv", INT4_GROUPS.value: "*u8"}
for format, weight in weights.items():
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION=None, FORMAT=format, GROUP=128)
    compiled(_gate_up_kernel, dict(hidden_ptr="*bf16", weight_ptr=weight, scales_ptr="*fp32", sorted_ptr="*i32",
                                   experts_ptr="*i32", out_ptr="*bf16"), dict(TOP_K=8, **tiles), num_warps=4)
    compiled(_down_kernel, dict(inter_ptr="*bf16", weight_ptr=weight, scales_ptr="*bf16", sorted_ptr="*i32",
                                experts_ptr="*i32", routing_ptr="*fp32", out_ptr="*fp32"), tiles, num_warps=4)
for format, weight, slots in ((INT4_GROUPS.value, "*u8", dict(SLOT=16, SLOTS=16)),
                              (ROW_SCALED.value, "*fp8e4nv", dict(SLOT=16, SLOTS=32))):
    compiled(_gate_up_pairs_kernel, dict(hidden_ptr="*bf16", weight_ptr=weight, scales_ptr="*bf16",
                                         experts_ptr="*i32", out_ptr="*bf16"),
             dict(TOP_K=8, BLOCK_N=16, FORMAT=format, GROUP=128, STEP=512, **slots), num_warps=4)
    compiled(_down_pairs_kernel, dict(inter_ptr="*bf16", weight_ptr=weight, scales_ptr="*bf16", experts_ptr="*i32",
                                      routing_ptr="*fp32", out_ptr="*fp32"),
             dict(BLOCK_N=32, FORMAT=format, GROUP=128, STEP=512, **slots), num_warps=4)
"""


def test_the_expert_kernels_compile_for_an_h200_in_every_weight_format_without_a_gpu():
    from compile_for_h200 import compile_for_h200

    done = compile_for_h200(COMPILE_GEMMS_FOR_SM90)

    assert done.returncode == 0, done.stderr


# Past a decode batch (our GEMV's rows), an fp8 layer also rounds each input row to float8 on a GPU (its
# scaled matmul): about 2.5% of the output's norm on normal data, against the full-precision input
# through the dequantized weight.
ON_GPU_ERROR = {"fp8": 0.05, "int8": 0.01}


@pytest.mark.cuda
@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")
@pytest.mark.parametrize("format", ["fp8", "int8"])
@pytest.mark.parametrize("tokens", [1, 16, 512])
@torch.inference_mode()
def test_on_a_gpu_a_full_size_quantized_projection_multiplies_bfloat16_rows_by_its_dequantized_weight(format, tokens):
    linear = torch.nn.Linear(2048, 4096, bias=False, device="cuda", dtype=torch.bfloat16)  # the Thinker's q_proj
    layer = QuantizedLinear.replacing(linear, format)
    assert layer.fp8_units == (format == "fp8") and layer.gemv
    x = torch.randn((tokens, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))

    out = layer(x.bfloat16()).float()

    reference = x @ dequantize(layer.weight, torch.float32).T
    assert ((out - reference).norm() / reference.norm()).item() <= ON_GPU_ERROR[format]
