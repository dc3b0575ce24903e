"""The GPU suite's folders (gpu_groups.py) are whole: a test file that needs the GPU for some test
cannot sit outside every group's folder, and every group is a folder of test files."""

import re
from pathlib import Path

from gpu_groups import GROUPS, TESTS, group_of

# How a test says it needs the GPU: the `cuda` marker, the shared app on the GPU (conftest's
# `on_gpu`, and the fixtures built on it), or a skip unless OMNI_LOCAL_TEST_DEVICE is cuda.
NEEDS_A_GPU = re.compile(r"mark\.cuda\b|\bon_gpu\b|speaking_graphed_and_eager|TEST_DEVICE != \"cuda\"")


def test_every_test_file_that_needs_a_gpu_is_in_a_gpu_group_folder():
    needing = [path for path in sorted(TESTS.rglob("test_*.py"))
               if path.name != Path(__file__).name and NEEDS_A_GPU.search(path.read_text())]
    assert needing  # the pattern still finds the suite's own GPU tests
    assert [str(path.relative_to(TESTS)) for path in needing if group_of(path) is None] == []


def test_every_gpu_group_is_a_folder_of_test_files_in_that_group():
    for group in GROUPS:
        files = sorted((TESTS / group).glob("test_*.py"))
        assert files, f"tests/{group}/ holds no test file"
        assert {group_of(path) for path in files} == {group}


def test_a_test_file_is_in_the_group_of_the_folder_of_tests_it_is_in():
    assert group_of(TESTS / "kernels" / "moe" / "test_routing.py") == "kernels"
    assert group_of(TESTS / "unit" / "test_settings.py") is None
