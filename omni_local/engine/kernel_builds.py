"""Every Triton kernel the engine launches, compiled for GPU architectures this machine need not have.

`engine_launches(gpu)` runs the engine's own launch functions (the GEMV, the MoE's routing, sort and
expert GEMMs, paged attention, the RMSNorm, the sampler's kernels) on meta-device tensors of the
real model's shapes, with the kernels and tiles the engine's tables choose for `gpu`
(triton_support.building_for), and records each launch instead of making it. `compile_launch`
compiles a recorded launch for an architecture as Triton's own launch would (its binder's types,
specialisations and options), for the compiled kernel's shared memory. fp8 weights and fp8 KV (the
Thinker's paged attention over fp8 pools) are built only where the engine takes them (compute
capability 8.9 on: `has_fp8_units`).

`python -m omni_local.engine.kernel_builds [--json PATH]` prints each architecture's builds;
tests/unit/test_kernel_builds.py checks that each compiles and fits its architecture's shared memory.
"""

import argparse
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_local.kernels.triton_support import KernelGpu, building_for, has_fp8_units
from omni_local.settings import CacheSettings, EngineSettings

ARCHITECTURES = (80, 86, 89, 90, 100, 120)
# Shared memory a block may take (opt-in), in bytes, by architecture: NVIDIA's CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability" ("Maximum amount of shared memory per
# thread block": 163 KB on 8.0, 99 KB on 8.6, 8.9 and 12.0, 227 KB on 9.0 and 10.0).
SHARED_MEMORY_PER_BLOCK = {80: 163 << 10, 86: 99 << 10, 89: 99 << 10, 90: 227 << 10, 100: 227 << 10,
                           120: 99 << 10}
# GPUs with tuned tile tables (kernels/gemv_tiles.py, kernels/moe/tile_configs/), built beside
# their architecture's defaults.
TUNED_GPUS = (KernelGpu("NVIDIA H200", (9, 0)),)
WEIGHTS = ("bf16", "fp8", "int4")


@dataclass(frozen=True)
class StackShape:
    """A decoder stack's sizes that pick kernels and tiles (vocab: its head's rows)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    moe_intermediate: int
    top_k: int
    vocab: int
    fp8_kv: bool  # whether kv_dtype = 'fp8' stores its KV in fp8 (the Thinker's; the Talker's stays)
    dtype: torch.dtype = torch.bfloat16  # the activations' ('auto' on a GPU)


# Qwen3-Omni-30B-A3B-Instruct's config (../shared/model-configs/qwen3-omni-30b-a3b-instruct.json):
# the Thinker's text model, the Talker's. (The demo model's, in float32 as the GPU tests run it, built
# too on 2026-12-06: its largest, the prefill's gate_up tile, took 98,304 bytes, inside 99 KiB. It
# is left out for the test's time: float32's attention builds take seconds each.)
STACKS = (StackShape("thinker", 2048, 32, 4, 128, 128, 768, 8, 152064, fp8_kv=True),
          StackShape("talker", 1024, 16, 2, 128, 128, 384, 6, 3072, fp8_kv=False))
# fused_draw's vocabularies, and whether their samplers suppress ids: the Talker's codec head (its
# special ids), its code predictor's (none).
DRAWS = ((3072, True), (2048, False))
# The defaults' shapes: the most tokens a MoE forward takes, and a KV block's rows.
PREFILL_TOKENS = EngineSettings().prefill_forward_tokens
KV_BLOCK_TOKENS = CacheSettings().kv_block_tokens
GEMV_ROWS = (1, 16)  # a decode batch's fewest and most


@dataclass(frozen=True)
class Launch:
    """A kernel launch as the engine makes it, and what it was for."""

    kernel: Any  # a triton JITFunction
    args: tuple
    kwargs: dict
    what: str


@contextmanager
def recorded_launches(into: list[Launch], what: str) -> Iterator[None]:
    """Kernel launches inside are appended to `into` (tagged `what`), not made."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        into.append(Launch(self, args, kwargs, what))

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = run


def engine_launches(gpu: KernelGpu) -> list[Launch]:
    """The launches the engine makes on `gpu`, for each stack and weights format it takes there, and
    its attention over fp8 KV where it takes that."""
    launches: list[Launch] = []
    token = building_for.set(gpu)
    try:
        fp8 = has_fp8_units(torch.device("meta"))
        formats = [w for w in WEIGHTS if w != "fp8" or fp8]
        for stack in STACKS:
            for weights in formats:
                _stack_launches(launches, stack, weights)
            if stack.fp8_kv and fp8:
                with recorded_launches(launches, f"{_dtype_tag(stack)}, fp8 KV"):
                    _attention_launches(stack, fp8_kv=True)
        _sampler_launches(launches)
    finally:
        building_for.reset(token)
    return launches


def _empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _dtype_tag(stack: StackShape) -> str:
    return f"{stack.name} {str(stack.dtype).removeprefix('torch.')}"


def _stack_launches(into: list[Launch], stack: StackShape, weights: str) -> None:
    with recorded_launches(into, f"{_dtype_tag(stack)}, {weights} weights"):
        _gemv_launches(stack, weights)
        _moe_launches(stack, weights)
        if weights == "bf16":  # attention and norms do not depend on the weights' format
            _attention_launches(stack, fp8_kv=False)
            _rms_norm_launches(stack)


def _gemv_launches(stack: StackShape, weights: str) -> None:
    """The attention projections (q, k and v fused; o), the router and the head, each as the
    `weights` setting stores it (bf16: the deterministic setting's invariant_matmul)."""
    from omni_local.kernels.gemv import gemv
    from omni_local.model.quantized.formats import quantize

    projections = [((stack.heads + 2 * stack.kv_heads) * stack.head_dim, stack.hidden),
                   (stack.hidden, stack.heads * stack.head_dim)]
    plain = [(stack.experts, stack.hidden), (stack.vocab, stack.hidden)]
    for rows in GEMV_ROWS:
        for out_features, in_features in projections + plain:
            weight = _empty(out_features, in_features, dtype=stack.dtype)
            x = _empty(rows, in_features, dtype=stack.dtype)
            if weights == "bf16" or (out_features, in_features) in plain:
                gemv(x, weight, None)
            else:  # int4 weights: int8 projections; a W4A16 checkpoint's int4 ones
                for format in ("fp8",) if weights == "fp8" else ("int8", "int4"):
                    quantized = quantize(weight, format)
                    gemv(x, quantized.values, quantized.scales)


def _moe_launches(stack: StackShape, weights: str) -> None:
    """Every kernel plan of 1 to PREFILL_TOKENS tokens, as start-up's warm-up meets them, in the
    default and the deterministic (pinned) form."""
    from omni_local.kernels.moe.expert_weights import kernel_weight
    from omni_local.kernels.moe.routed_experts import first_count_of_each_plan, weighted_expert_rows
    from omni_local.model.quantized.formats import quantize

    gate_up = _empty(stack.experts, 2 * stack.moe_intermediate, stack.hidden, dtype=stack.dtype)
    down = _empty(stack.experts, stack.hidden, stack.moe_intermediate, dtype=stack.dtype)
    gate_up_scales = down_scales = None
    if weights != "bf16":
        (gate_up, gate_up_scales), (down, down_scales) = _stored(quantize(gate_up, weights)), _stored(
            quantize(down, weights))
    kernel_weights = kernel_weight(gate_up, gate_up_scales), kernel_weight(down, down_scales)
    for pinned in (False, True):
        for tokens in first_count_of_each_plan(PREFILL_TOKENS, stack.top_k, *kernel_weights, torch.device("meta"),
                                               pinned):
            hidden = _empty(tokens, stack.hidden, dtype=stack.dtype)
            weighted_expert_rows(hidden, _empty(tokens, stack.experts, dtype=stack.dtype), gate_up, down, stack.top_k,
                                 True, None, gate_up_scales, down_scales, pinned)


def _stored(quantized: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return quantized.values, quantized.scales


def _attention_launches(stack: StackShape, fp8_kv: bool) -> None:
    """A decode step, a short tail and a prefill chunk on a cached prefix, each with the query's
    norm and rotary in the kernel and without, and in the batch-invariant form; over pools in the
    stack's dtype, or with `fp8_kv` fp8 ones with their rows' scales (engine/memory/kv_fp8.py)."""
    from omni_local.kernels.attention import QueryNormRope
    from omni_local.kernels.attention.paged import SPLIT_TAIL_TOKENS, paged_attention
    from omni_local.engine.memory.kv_fp8 import SCALE_DTYPE
    from omni_local.model.quantized.formats import FP8

    blocks = 256  # a table of 4,096 rows
    pool = _empty(blocks, stack.kv_heads, KV_BLOCK_TOKENS, stack.head_dim, dtype=FP8 if fp8_kv else stack.dtype)
    row_scales = _empty(*pool.shape[:3], dtype=SCALE_DTYPE)
    scales = (row_scales, row_scales) if fp8_kv else None
    for length in (1, SPLIT_TAIL_TOKENS // 2, 4 * SPLIT_TAIL_TOKENS):
        batch = 4 if length == 1 else 1
        query = _empty(batch, stack.heads, length, stack.head_dim, dtype=stack.dtype)
        tables = _empty(batch, blocks, dtype=torch.int32)
        rows = _empty(batch, length, dtype=torch.int64)
        rotary = _empty(batch, length, stack.head_dim, dtype=stack.dtype)
        norm_rope = QueryNormRope(_empty(stack.head_dim, dtype=stack.dtype), 1e-6, rotary, rotary)
        for batch_invariant in (False, True):
            for query_norm_rope in (None, norm_rope):
                paged_attention(query, pool, pool, tables, rows, 0.088, batch_invariant=batch_invariant,
                                norm_rope=query_norm_rope, scales=scales)


def _rms_norm_launches(stack: StackShape) -> None:
    """The deterministic setting's RMSNorms: over hidden, and over head_dim (q_norm, k_norm)."""
    from omni_local.kernels.rms_norm import rms_norm

    for width in (stack.hidden, stack.head_dim):
        # The op's own function: the op itself takes meta tensors to its fake, which launches nothing.
        rms_norm._init_fn(_empty(4, width, dtype=stack.dtype), _empty(width, dtype=stack.dtype), 1e-6)


def _sampler_launches(into: list[Launch]) -> None:
    """The sampler's uniform numbers, and the Talker's one-kernel draws, greedy and sampled."""
    from omni_local.kernels.sampling.fused_draw import fused_draw
    from omni_local.kernels.sampling.uniform_noise import kernel_uniform_numbers

    long = torch.long
    with recorded_launches(into, "sampler"):
        kernel_uniform_numbers(_empty(4, dtype=long), _empty(152064, dtype=long))
        for vocab, suppresses in DRAWS:
            suppressed = _empty(vocab, dtype=torch.bool) if suppresses else None
            for sampling in (False, True):
                fused_draw(_empty(2, vocab), _empty(2, dtype=long), _empty(2, dtype=long), _empty(8),
                           _empty(8, dtype=long), _empty(8), _empty(8), _empty(8, vocab, dtype=torch.bool), suppressed,
                           _empty(vocab, dtype=long), _empty(8, dtype=long), sampling)


@dataclass(frozen=True)
class Compiled:
    """One distinct kernel build of an architecture: the kernel, what first launched it, its
    constants, and the compiled kernel's shared memory (bytes) or the compiler's error."""

    kernel: str
    what: str
    constants: str
    shared: int | None
    error: str | None
    seconds: float


def compile_launch(launch: Launch, arch: int) -> Any:
    """`launch`'s kernel compiled for `arch` as Triton's launch would compile it there."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    # As JITFunction.run binds a launch's arguments (Triton 3.6 to 3.8), for the target's backend.
    kernel, target = launch.kernel, GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params,
                                                                    backend)(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def arch_builds(arch: int) -> list[Compiled]:
    """Each distinct choice of the engine's launches on `arch`'s GPUs (its tuned GPUs' tables too),
    compiled for `arch`."""
    gpus = [KernelGpu(None, divmod(arch, 10))] + [g for g in TUNED_GPUS if g.capability == divmod(arch, 10)]
    choices = {}
    for gpu in gpus:
        for launch in engine_launches(gpu):
            choices.setdefault(_choice(launch), launch)
    return [_compiled(launch, arch) for launch in choices.values()]


def _choice(launch: Launch) -> tuple:
    """What the engine chose for a launch: the kernel, its pointers' dtypes, its constants and
    options. Not the integers' values, which Triton also specialises on (1, multiples of 16): each
    specialisation would be a compile of the same tiles, and the test's time is CI's."""
    dtypes = tuple(str(arg.dtype) if isinstance(arg, torch.Tensor) else type(arg).__name__ for arg in launch.args)
    return launch.kernel.fn.__qualname__, launch.kernel.fn.__module__, dtypes, tuple(sorted(launch.kwargs.items()))


def _compiled(launch: Launch, arch: int) -> Compiled:
    constants = ", ".join(f"{k}={v}" for k, v in launch.kwargs.items() if k[0].isupper() or k.startswith("num_"))
    start = time.perf_counter()
    try:
        shared, error = compile_launch(launch, arch).metadata.shared, None
    except Exception as exception:  # the compiler's refusal is the finding
        shared, error = None, f"{type(exception).__name__}: {str(exception).strip().splitlines()[-1]}"
    return Compiled(launch.kernel.fn.__name__, launch.what, constants, shared, error, time.perf_counter() - start)


def all_builds(architectures: tuple[int, ...] = ARCHITECTURES) -> dict[int, list[Compiled]]:
    """Each architecture's builds, compiled in worker processes (one a CPU core)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): run without it to compile")
    with ProcessPoolExecutor(min(len(architectures), os.cpu_count() or 1)) as pool:
        # sm_90's first: it has its tuned GPUs' builds too, the most
        ordered = sorted(architectures, key=lambda arch: arch != 90)
        return {arch: builds for arch, builds in sorted(zip(ordered, pool.map(arch_builds, ordered)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--json", type=Path, help="write the builds here")
    args = parser.parse_args()
    builds = all_builds(tuple(args.arch))
    for arch, compiled in builds.items():
        for c in compiled:
            fits = c.shared is not None and c.shared <= SHARED_MEMORY_PER_BLOCK[arch]
            print(f"sm_{arch} {c.kernel:24} {c.what:32} {c.error or f'{c.shared} B' + ('' if fits else ' TOO MUCH')}"
                  f"  {c.seconds:.2f} s  {c.constants}")
    if args.json:
        args.json.write_text(json.dumps({arch: [c.__dict__ for c in compiled] for arch, compiled in builds.items()}))


if __name__ == "__main__":
    main()
