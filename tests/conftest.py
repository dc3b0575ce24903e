"""Fixtures shared by the test files of every folder (their helpers are in tests/support/): the demo
checkpoint, built once per session, its model and the apps on it, and on the tiny Thinking and
Captioner checkpoints written from it; bad uploads; the prompts an engine builds, and the ids they
must have; a small disk to fill up; and the tests that need a CUDA GPU (marked `cuda`) or torchvision (marked
`torchvision`), skipped, saying why, where it is missing.

The demo runs on the CPU unless OMNI_LOCAL_TEST_DEVICE names another device (`cuda` on a GPU
machine, where decode steps and short prefills run as CUDA graphs). It runs in float32 on every device: the tests
compare tokens with transformers' own, and in bfloat16 two attention kernels' rounding can already
flip a greedy choice of the tiny random model.
"""

import os

from device_under_test import TEST_DEVICE  # tests/support/, on the path by pyproject.toml's pytest section

# On the CPU, our Triton kernels (the `triton` MoE backend) run in Triton's interpreter. `triton.jit`
# reads the variable as it decorates a function, its own language's functions at triton's import
# (which importing transformers' models makes), so it is set before any import here. On a GPU run the
# kernels are compiled, as in the app.
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter's tl.dot is numpy's matmul, through OpenBLAS, whose kernel the CPU or
    # OPENBLAS_CORETYPE picks (our machines set Haswell): with numpy 2.4's OpenBLAS 0.3.31 the Haswell
    # and Zen kernels give equal rows of A different bits in A @ B by where they stand, so a test of
    # a row's bits alone and among others would test OpenBLAS. Its AVX kernel, which every x86-64 CPU
    # of these years runs, computes each row alike. Read when numpy loads OpenBLAS: before any import.
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import subprocess  # noqa: E402 (after the variable)
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.utils import is_torchvision_available

from bad_files import write_bad_files
from checkpoint_family import write_captioner, write_thinking
from gpu_groups import GROUPS, group_of
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.model import LoadedModel, load_model
from omni_local.model.demo import ensure_demo_checkpoint
from omni_local.protocol.messages import Message
from omni_local.settings import Settings

# The browser, its tabs and their screenshots, for every module of browser tests.
pytest_plugins = ["browser_page"]



@pytest.fixture(scope="session")
def demo_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Default settings, with the demo model and every cache in a private temporary folder."""
    root = tmp_path_factory.mktemp("omni_local")
    return Settings(
        model="demo", demo_dir=str(root / "demo"), cache_dir=str(root / "cache"),
        device=TEST_DEVICE, dtype="float32",
        gpu_cache_bytes=64 << 20,  # 32 chats of the demo's 2 KiB per token x 1024 tokens
        host_cache_bytes=64 << 20,  # allocated (and on a GPU page-locked) by every app a test starts
        max_context_tokens=1024, max_prompt_tokens=960,
    )


@pytest.fixture(scope="session")
def demo_checkpoint(demo_settings: Settings) -> Path:
    return ensure_demo_checkpoint(demo_settings.demo_path)


@pytest.fixture(scope="session")
def thinking_checkpoint(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-Omni Thinking (checkpoint_family.py)."""
    return write_thinking(demo_checkpoint, tmp_path_factory.mktemp("family") / "thinking")


@pytest.fixture(scope="session")
def captioner_checkpoint(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-Omni Captioner (checkpoint_family.py)."""
    return write_captioner(demo_checkpoint, tmp_path_factory.mktemp("family") / "captioner")


@pytest.fixture(scope="module")
def thinking(demo_settings: Settings, thinking_checkpoint: Path):
    """The whole app on the tiny Thinking checkpoint, for one test file."""
    from omni_local.api import OmniLocal

    with OmniLocal(demo_settings.replace(model=str(thinking_checkpoint))) as running:
        yield running


@pytest.fixture(scope="module")
def captioner(demo_settings: Settings, captioner_checkpoint: Path):
    """The whole app on the tiny Captioner checkpoint, for one test file."""
    from omni_local.api import OmniLocal

    with OmniLocal(demo_settings.replace(model=str(captioner_checkpoint))) as running:
        yield running


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
def make_apps(demo_checkpoint: Path):
    """`make_apps(settings)`: the same model twice on `settings`, with every cache and with every cache
    off; closed after the test file."""
    from omni_local.api import OmniLocal

    with ExitStack() as opened:
        def make(settings: Settings) -> tuple[OmniLocal, OmniLocal]:
            off = settings.replace(prefix_cache=False, encoder_cache=False)
            return opened.enter_context(OmniLocal(settings)), opened.enter_context(OmniLocal(off))

        yield make


@pytest.fixture(scope="module")
def apps(demo_settings: Settings, make_apps):
    """The same model twice: with every cache, and with every cache off."""
    return make_apps(demo_settings)


@pytest.fixture
def built_prompts(monkeypatch: pytest.MonkeyPatch) -> list[Prompt]:
    """Every prompt an engine builds while the test runs, in order: the ids the model is given."""
    import omni_local.engine.prompt.context_window as context_window

    built: list[Prompt] = []

    def building(messages: list[Message], processor: Any, reasoning: Any = None) -> Prompt:
        built.append(build_prompt(messages, processor, reasoning))
        return built[-1]

    monkeypatch.setattr(context_window, "build_prompt", building)
    return built


@pytest.fixture(scope="session")
def template_ids(demo_model: LoadedModel) -> Callable[[str, str], list[int]]:
    """The ids of a prompt of a system prompt and one question, as they must be: the template's
    control tokens where it puts them, and each text, whatever it holds, as plain text (the text's
    ids with no special token recognized). For texts that begin with a letter or `<`, so the seams
    between them and the template's text tokenize alike whole or apart."""
    tokenizer = demo_model.processor.tokenizer

    def template(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def plain(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def ids(system: str, question: str) -> list[int]:
        return (template("<|im_start|>system\n") + plain(system) + template("<|im_end|>\n<|im_start|>user\n")
                + plain(question) + template("<|im_end|>\n<|im_start|>assistant\n"))

    return ids


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-group", action="append", choices=[*GROUPS, "all"], default=[],
                     help="collect only the test files of this GPU group's folder (tests/kernels, tests/engine, "
                          "tests/models; repeatable, or 'all')")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --gpu-group, only that group's folder's test files are collected: the others are not even
    imported, so a GPU machine without the page's or the server's packages runs the suite."""
    chosen = config.getoption("gpu_group")
    if not chosen or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    group = group_of(collection_path)
    return group is None or ("all" not in chosen and group not in chosen)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (CUDA graphs); skipped where none is visible")
    config.addinivalue_line("markers", "torchvision: reads a video, which needs torchvision; skipped without it")
    config.addinivalue_line("markers", "gpu: a test of the GPU suite (tests/kernels, engine, models); run with "
                                       "OMNI_LOCAL_TEST_DEVICE=cuda")
    for group, about in GROUPS.items():
        config.addinivalue_line("markers", f"gpu_{group}: the GPU suite's group {group!r} (tests/{group}/): {about}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    missing = {}  # marker -> the skip for a test that has it
    if not torch.cuda.is_available():
        missing["cuda"] = pytest.mark.skip(reason="CUDA graphs need a CUDA GPU, and none is visible")
    # The check `load_processor` makes: without torchvision the app refuses every video.
    if not is_torchvision_available():
        missing["torchvision"] = pytest.mark.skip(
            reason="video needs torchvision (transformers' video processor), which is not installed")
    for item in items:
        if group := group_of(item.path):
            item.add_marker("gpu")
            item.add_marker(f"gpu_{group}")
        for marker, skip in missing.items():
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def on_gpu(app):
    """The shared app, for a test that needs the demo on the GPU (OMNI_LOCAL_TEST_DEVICE=cuda)."""
    if app.backend.engine.runner.device.type != "cuda":
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
