"""Start-up faults end with one line and exit status 2, before the model loads, and never change a
folder the app did not create: `python app.py` and `python -m omni_local` alike."""

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_local.cli import main
from omni_local.errors import CheckpointError, SettingsError
from omni_local.folders import private_folder
from omni_local.model import demo
from omni_local.model.demo import ensure_demo_checkpoint
from omni_local.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def run_app(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", *flags], cwd=REPO, capture_output=True, text=True, timeout=120)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.write_text("not a folder")
    return path


@pytest.fixture
def read_only_folder(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """An empty folder nobody may write in: mode 0500, or, for root, whom modes do not stop, a
    read-only tmpfs."""
    if os.geteuid() == 0:
        folder = request.getfixturevalue("mountable")
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
        return
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    yield folder
    folder.chmod(0o700)  # for pytest to remove it


def test_app_py_refuses_a_cache_dir_that_is_a_file_with_one_line_and_status_2(a_file):
    done = run_app("--cache-dir", str(a_file))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: cannot create folder '{a_file / 'uploads'}': '{a_file}' is a file, not a folder"
    ]


def test_app_py_refuses_a_read_only_cache_folder_with_one_line_and_status_2(read_only_folder):
    done = run_app("--cache-dir", str(read_only_folder))
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: cannot create folder '{read_only_folder / 'uploads'}': ")
    assert line.endswith(("Read-only file system", "Permission denied"))


def test_the_cli_refuses_a_cache_dir_that_is_a_file_with_one_line_and_status_2(a_file, capsys):
    assert main(["ask", "Hi", "--cache-dir", str(a_file)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: '{a_file}' is a file, not a folder"]


def test_the_cli_refuses_a_read_only_cache_folder_with_one_line_and_status_2(read_only_folder, capsys):
    assert main(["ask", "Hi", "--cache-dir", str(read_only_folder)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: cannot write the demo model to '{read_only_folder / 'demo'}': ")


def test_app_py_refuses_a_gpu_cache_too_small_for_any_model_before_loading_one():
    done = run_app("--gpu-cache-bytes", "1", "--model", "/nonexistent")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: setting 'gpu_cache_bytes' (1) is below the 32,768 bytes")


def _quick_demo(folder: Path, size: object) -> None:
    """Stands in for the demo's builder (seconds of work) where only its folders matter."""
    marker = {"builder_version": demo.BUILDER_VERSION}
    (folder / demo.MARKER_FILE).write_text(json.dumps(marker), encoding="utf-8")


def test_the_demo_leaves_the_folders_it_did_not_create_as_they_were(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "_write_checkpoint", _quick_demo)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as the system's temporary folder: its sticky bit keeps users' files apart
    path = ensure_demo_checkpoint(Settings(cache_dir=str(shared)).demo_path)  # shared/demo: --demo-dir names it too
    assert mode(shared) == 0o1777
    assert mode(path) == 0o700
    deeper = ensure_demo_checkpoint(shared / "made" / "on the way" / "demo")
    assert mode(shared / "made") == mode(shared / "made" / "on the way") == mode(deeper) == 0o700
    assert mode(shared) == 0o1777


def test_a_demo_dir_holding_other_files_is_refused_and_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "_write_checkpoint", _quick_demo)
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="'.*documents' holds files that are not a demo model"):
        ensure_demo_checkpoint(documents)
    assert (documents / "notes.txt").read_text() == "mine"


def test_an_existing_folder_open_to_others_is_refused_and_its_mode_left_alone(tmp_path):
    folder = tmp_path / "uploads"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(SettingsError, match=r"uploads' is open to other users \(mode 0755\): make it private"):
        private_folder(folder)
    assert mode(folder) == 0o755


def test_an_existing_folder_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    folder = tmp_path / "uploads"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)  # nobody
    with pytest.raises(SettingsError, match="uploads' belongs to another user"):
        private_folder(folder)
