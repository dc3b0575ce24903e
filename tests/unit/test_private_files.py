"""What the app writes is the user's alone: after `python app.py` and `python -m omni_local` have
run (an upload through Gradio, encoder outputs on disk, a saved chat, the demo model built), every
folder under the cache folder is 0700 and every file 0600, the libraries' own files included."""

import stat
import subprocess
import sys
from pathlib import Path

from gradio_client import Client, handle_file

from bad_files import good_image
from samples import picture
from served_app import REPO, served_app


def not_private(root: Path) -> list[str]:
    """Each folder under `root` (and itself) that is not 0700 and each file not 0600, with its mode."""
    wrong = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode != (0o700 if path.is_dir() else 0o600):
            wrong.append(f"{path.relative_to(root)}: {mode:04o}")
    return wrong


def test_the_ui_writes_only_private_folders_and_files(demo_settings, demo_checkpoint, tmp_path):
    with served_app(demo_settings, tmp_path) as app:
        upload = handle_file(str(good_image(tmp_path)))
        Client(app.url, verbose=False).predict({"text": "What is this?", "files": [upload]}, "", api_name="/chat")
        written = {path.relative_to(app.cache_dir).parts[0] for path in app.cache_dir.rglob("*") if path.is_file()}
        assert written >= {"uploads", "encoders", "chats"}
        assert not_private(app.cache_dir) == []


def test_the_command_line_writes_only_private_folders_and_files(tmp_path):
    cache = tmp_path / "cache"  # the demo model is built in it too
    photo = tmp_path / "photo.png"
    picture(1, (640, 480)).save(photo)  # encoder outputs large enough for diskcache to keep in files of their own
    done = subprocess.run(
        [sys.executable, "-m", "omni_local", "ask", "What is this?", "--image", str(photo), "--cache-dir", str(cache),
         "--device", "cpu", "--max-new-tokens", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (cache / "demo" / "model.safetensors").is_file() and any(cache.glob("encoders/*/*/*.val"))
    assert not_private(cache) == []
