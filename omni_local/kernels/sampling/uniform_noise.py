"""The sampler's uniform numbers (engine/forward/sampling.py's `uniform_numbers`) as one Triton kernel, on a
GPU.

engine/forward/sampling.py hashes each (row key, token key) pair with int64 tensor ops that emulate 32-bit
products: 23 kernels a draw of the Thinker's batch. Here each program hashes a tile of a row's
tokens in uint32 arithmetic, which wraps as the emulation does, and keeps the top 23 bits as a
float32, an exact conversion: the same bits. The logarithms of the Gumbel noise stay torch's, whose
rounding the CPU shares. `hashed_uniform` is also fused_draw.py's (the Talker's small vocabularies)."""

import torch
import triton
import triton.language as tl

from omni_local.kernels.sampling.hash32 import HASH_MULTIPLIERS, HASH_SHIFTS, UNIFORM_BITS

BLOCK = 1024  # tokens a program
_FIRST_SHIFT, _SECOND_SHIFT, _THIRD_SHIFT = (tl.constexpr(shift) for shift in HASH_SHIFTS)
_FIRST_MULTIPLIER, _SECOND_MULTIPLIER = (tl.constexpr(multiplier) for multiplier in HASH_MULTIPLIERS)
_DROPPED_BITS = tl.constexpr(32 - UNIFORM_BITS)
_SCALE = tl.constexpr(1.0 / 2**UNIFORM_BITS)


@triton.jit
def hashed_uniform(token_keys, key):
    """float32 numbers strictly inside (0, 1) of a row's `key` (uint32) and its tokens' `token_keys`
    (uint32, a block): sampling.py's hash and `_uniform`, bit for bit."""
    x = token_keys ^ key
    x = x ^ (x >> _FIRST_SHIFT)
    x = x * tl.full(x.shape, _FIRST_MULTIPLIER, tl.uint32)  # products wrap in 32 bits, as the emulation's
    x = x ^ (x >> _SECOND_SHIFT)
    x = x * tl.full(x.shape, _SECOND_MULTIPLIER, tl.uint32)
    x = x ^ (x >> _THIRD_SHIFT)
    return ((x >> _DROPPED_BITS).to(tl.float32) + 0.5) * _SCALE


# The vocabulary and the keys' address vary (a frame's keys are slices of one tensor): one compile
# serves them all, made at start-up.
@triton.jit(do_not_specialize=["vocab"], do_not_specialize_on_alignment=["keys_ptr"])
def _uniform_kernel(keys_ptr, token_keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    key = tl.load(keys_ptr + row).to(tl.uint32)
    token_keys = tl.load(token_keys_ptr + tokens, mask=inside, other=0).to(tl.uint32)
    tl.store(out_ptr + row.to(tl.int64) * vocab + tokens, hashed_uniform(token_keys, key), mask=inside)


def kernel_uniform_numbers(keys: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """sampling.uniform_numbers(keys, token_keys), bit for bit: [B, vocab] float32."""
    vocab = token_keys.shape[0]
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    _uniform_kernel[(keys.shape[0], triton.cdiv(vocab, BLOCK))](keys, token_keys, out, vocab, BLOCK=BLOCK,
                                                                 num_warps=4)
    return out
