"""The GPU suite's file list (gpu_groups.py) is whole: a test file that needs the GPU for some test
cannot be left out of every group, and every file a group names exists."""

import re
from pathlib import Path

from gpu_groups import GROUPS, group_of

TESTS = Path(__file__).resolve().parent
# How a test says it needs the GPU: the `cuda` marker, the shared app on the GPU (conftest's
# `on_gpu`, and the fixtures built on it), or a skip unless OMNI_LOCAL_TEST_DEVICE is cuda.
NEEDS_A_GPU = re.compile(r"mark\.cuda\b|\bon_gpu\b|speaking_graphed_and_eager|TEST_DEVICE != \"cuda\"")


def test_every_test_file_that_needs_a_gpu_is_in_a_gpu_group():
    needing = [path.name for path in sorted(TESTS.glob("test_*.py"))
               if path.name != Path(__file__).name and NEEDS_A_GPU.search(path.read_text())]
    assert needing  # the pattern still finds the suite's own GPU tests
    assert [name for name in needing if group_of(TESTS / name) is None] == []


def test_every_file_a_gpu_group_names_is_a_test_file_of_one_group_only():
    named = [name for files in GROUPS.values() for name in files]
    assert [name for name in named if not (TESTS / name).is_file()] == []
    assert len(named) == len(set(named))
