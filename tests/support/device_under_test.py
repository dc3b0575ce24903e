"""The device the tests run the demo on: the CPU unless OMNI_LOCAL_TEST_DEVICE names another (`cuda`
on a GPU machine). conftest.py reads it before any other import, to set up Triton's interpreter."""

import os

TEST_DEVICE = os.environ.get("OMNI_LOCAL_TEST_DEVICE", "cpu")
