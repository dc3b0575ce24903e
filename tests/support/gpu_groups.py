"""The GPU tests, in one place: the test files whose behaviour depends on running on a CUDA GPU (CUDA
graphs, our compiled Triton kernels, compiled layers, page-locked memory, tensors on the device), in
groups that each finish in under 8 minutes on one H100 (docs/testing.md has their times). A group is
a folder of tests/: a test file's group is the folder it is in.

conftest.py marks every test of these folders `gpu` and `gpu_<group>`, and `--gpu-group` collects
only its folder's files, so one command runs a group:

    OMNI_LOCAL_TEST_DEVICE=cuda python -m pytest --gpu-group kernels

On the CPU (the README's test command) the same tests run too, where they can: the demo model on the
CPU and our kernels in Triton's interpreter; the ones that need the GPU skip, saying why.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

GROUPS: dict[str, str] = {
    "kernels": "our Triton kernels and the compiled regions around them, each against a plain-PyTorch oracle",
    "engine": "the engine on the GPU: graphed steps and prefills, the prefix cache and host tier, scheduling",
    "models": "the checkpoints, weights formats and media beyond text: speech, video, quantized weights",
}


def group_of(test_file: Path) -> str | None:
    """The GPU group a test file belongs to (the folder of tests/ it is in), or None for a test file
    that does not need the GPU."""
    path = test_file.resolve()
    folder = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
    return folder if folder in GROUPS else None
