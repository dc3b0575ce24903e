"""Fixtures shared by the test files: the demo checkpoint, built once per session, its model and
the apps on it; bad uploads; a small disk to fill up; and the tests that need a CUDA GPU (marked `cuda`).

The demo runs on the CPU unless OMNI_LOCAL_TEST_DEVICE names another device (`cuda` on a GPU
machine, where decode steps and short prefills run as CUDA graphs). It runs in float32 on every device: the tests
compare tokens with transformers' own, and in bfloat16 two attention kernels' rounding can already
flip a greedy choice of the tiny random model.
"""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bad_files import write_bad_files
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


@pytest.fixture(scope="module")
def apps(demo_settings: Settings, demo_checkpoint: Path):
    """The same model twice: with every cache, and with every cache off."""
    from omni_local.api import OmniLocal

    off = demo_settings.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(demo_settings) as cached, OmniLocal(off) as uncached:
        yield cached, uncached


@pytest.fixture
def mountable(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs folder, to fill up or make read-only (needs root's mount, as on CI)."""
    folder = tmp_path / "mnt"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("a full or read-only folder is made with mount, which needs root")
    yield folder
    subprocess.run(["umount", "--lazy", str(folder)], check=False)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """bad_files.py's uploads: name -> (file, a phrase its error message must hold)."""
    return write_bad_files(tmp_path_factory.mktemp("bad"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (CUDA graphs); skipped where none is visible")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="CUDA graphs need a CUDA GPU, and none is visible")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(no_gpu)


@pytest.fixture(scope="module")
def on_gpu(app):
    """The shared app, for a test that needs the demo on the GPU (OMNI_LOCAL_TEST_DEVICE=cuda)."""
    if app.engine.runner.device.type != "cuda":
        pytest.skip("the demo model runs on the CPU: set OMNI_LOCAL_TEST_DEVICE=cuda")
    return app


@pytest.fixture(scope="module")
def speaking_graphed_and_eager(on_gpu, demo_settings: Settings):
    """The demo with speech twice: the Talker's steps and Code2Wav's chunks graphed, and eager.
    Replies stop at 4 s, 50 codec frames: a Talker prompt under the smallest bucket ends past it."""
    from omni_local.api import OmniLocal

    settings = demo_settings.replace(speech=True, max_speech_seconds=4.0)
    with OmniLocal(settings) as graphed, OmniLocal(settings.replace(cuda_graphs=False)) as eager:
        yield graphed, eager
