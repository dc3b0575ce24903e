"""The query, key and value projections fused into one weight give each projection's outputs bit for
bit (on the CPU), in every weight format, hold their weights once, and leave transformers' own
projections working as views of the fused rows."""

from types import SimpleNamespace

import pytest
import torch

from omni_local.engine.forward.fused_qkv import fuse_qkv, split_qkv
from omni_local.model.quantized import QuantizedLinear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 32  # int4's groups of 128 need a multiple of 128 inputs


def attention_layer(format: str | None, bias: bool = False) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    attention = torch.nn.Module()
    for name, heads in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS)):
        linear = torch.nn.Linear(HIDDEN, heads * HEAD_DIM, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / HIDDEN ** 0.5)
            if bias:
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator))
        setattr(attention, name, linear if format is None else QuantizedLinear.replacing(linear, format))
    return attention


def outputs(attention: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@pytest.mark.parametrize("format", [None, "int8", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 7])
def test_the_fused_projection_gives_each_projections_outputs_bit_for_bit(format, rows):
    attention = attention_layer(format)
    x = torch.randn((1, rows, HIDDEN), generator=torch.Generator().manual_seed(1))
    expected, before = outputs(attention, x), held_bytes(attention)
    fuse_qkv(SimpleNamespace(layers=[SimpleNamespace(self_attn=attention)]))
    for got, want in zip(split_qkv(attention, x), expected):
        assert torch.equal(got, want)
    # transformers' forward still calls q_proj, k_proj and v_proj: views of the fused rows now.
    for got, want in zip(outputs(attention, x), expected):
        assert torch.equal(got, want)
    assert set(dict(attention.named_children())) == {"qkv_proj"}
    assert held_bytes(attention) == before


def test_biases_are_fused_with_their_rows():
    attention = attention_layer(None, bias=True)
    x = torch.randn((1, 3, HIDDEN), generator=torch.Generator().manual_seed(2))
    expected = outputs(attention, x)
    fuse_qkv(SimpleNamespace(layers=[SimpleNamespace(self_attn=attention)]))
    for got, want in zip(split_qkv(attention, x), expected):
        assert torch.equal(got, want)


def test_a_fused_stack_is_left_as_it_is_when_fused_again():
    attention = attention_layer(None)
    stack = SimpleNamespace(layers=[SimpleNamespace(self_attn=attention)])
    fuse_qkv(stack)
    fused = attention.qkv_proj
    fuse_qkv(stack)
    assert attention.qkv_proj is fused
