"""Fixtures shared by the test files: the demo checkpoint, built once per session, and its model.

The demo runs on the CPU unless OMNI_LOCAL_TEST_DEVICE names another device (`cuda` on a GPU
machine, where decode steps and short prefills run as CUDA graphs). It runs in float32 on every device: the tests
compare tokens with transformers' own, and in bfloat16 two attention kernels' rounding can already
flip a greedy choice of the tiny random model.
"""

import os
from pathlib import Path

import pytest

from omni_local.model import LoadedModel, load_model
from omni_local.model.demo import ensure_demo_checkpoint
from omni_local.settings import Settings


@pytest.fixture(scope="session")
def demo_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Default settings, with the demo model and every cache in a private temporary folder."""
    root = tmp_path_factory.mktemp("omni_local")
    return Settings(
        model="demo", demo_dir=str(root / "demo"), cache_dir=str(root / "cache"),
        device=os.environ.get("OMNI_LOCAL_TEST_DEVICE", "cpu"), dtype="float32",
        gpu_cache_bytes=64 << 20,  # 32 chats of the demo's 2 KiB per token x 1024 tokens
        max_context_tokens=1024, max_prompt_tokens=960,
    )


@pytest.fixture(scope="session")
def demo_checkpoint(demo_settings: Settings) -> Path:
    return ensure_demo_checkpoint(demo_settings.demo_path)


@pytest.fixture(scope="session")
def demo_model(demo_settings: Settings, demo_checkpoint: Path) -> LoadedModel:
    """The demo model as the app loads it: Thinker only (speech off), float32."""
    return load_model(demo_settings)


@pytest.fixture(scope="session")
def app(demo_settings: Settings, demo_checkpoint: Path):
    """The whole app on the demo model, its engine running, shared by the tests that only send requests."""
    from omni_local.api import OmniLocal

    with OmniLocal(demo_settings) as running:
        yield running


@pytest.fixture(scope="session")
def speaking_app(demo_settings: Settings, demo_checkpoint: Path):
    """The app with the Talker, for spoken replies. Replies are long (the demo's Talker rarely ends
    on its own), so one is still playing when the person speaks again."""
    from omni_local.api import OmniLocal

    with OmniLocal(demo_settings.replace(speech=True, max_speech_seconds=30.0)) as running:
        yield running
