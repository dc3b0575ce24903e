"""Triton kernels compiled for an H200 (sm_90 cubin, ptxas included) on a machine without a GPU.

The interpreter runs loosely what the compiler refuses (a global that is not a constexpr, say), so
each kernel file's tests compile its kernels too. The compiler runs in a child process: this one's
triton was imported with TRITON_INTERPRET=1 and would interpret them."""

import os
import subprocess
import sys
from pathlib import Path

# A script's preamble: `compiled(kernel, pointers, constexprs, aligned=(), **options)` compiles
# `kernel`, its pointer arguments typed as in `pointers` ("*bf16", "fp32"), every other argument
# "i32", and the `constexprs` fixed to their values, and returns it compiled. The arguments named in
# `aligned` are taken as multiples of 16, as a launch specializes them where they are (pointers from
# torch's allocator, sizes and strides of 2,048): Triton vectorizes and pipelines those loads.
COMPILER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compiled(kernel, pointers, constexprs, aligned=(), **options):
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    where = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(kernel, signature, where, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)
"""


def compile_for_h200(script: str) -> subprocess.CompletedProcess:
    """Runs `script` (which calls `compiled`) after the preamble, from the repository's root."""
    compiler = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", COMPILER + script], cwd=Path(__file__).resolve().parents[2],
                          env=compiler, capture_output=True, text=True, timeout=300)
