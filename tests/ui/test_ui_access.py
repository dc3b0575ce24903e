"""Who can reach the UI: loopback only unless credentials are given, and they must be private."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_local.access import is_loopback
from omni_local.errors import SettingsError
from omni_local.settings import Settings
from omni_local.ui.access import keep_uploads_private, launch_options, read_credentials

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                 ("0.0.0.0", False), ("192.168.1.5", False), ("myhost", False)])
def test_only_loopback_addresses_count_as_this_machine(host, loopback):
    assert is_loopback(host) is loopback


def test_the_default_serves_this_machine_only_with_no_login():
    options = launch_options(Settings())
    assert options["server_name"] == "127.0.0.1" and "auth" not in options


def test_serving_beyond_this_machine_without_credentials_is_refused():
    with pytest.raises(SettingsError, match="ui_host = '0.0.0.0'.*needs credentials"):
        launch_options(Settings(ui_host="0.0.0.0"))


def credentials(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "users"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_private_credentials_open_the_ui_beyond_this_machine_with_a_login(tmp_path):
    path = credentials(tmp_path, "ada:lovelace\ngrace:hopper:cobol\n")
    options = launch_options(Settings(ui_host="0.0.0.0", ui_credentials_file=str(path)))
    assert options["auth"] == [("ada", "lovelace"), ("grace", "hopper:cobol")]


@pytest.mark.parametrize(
    ("text", "mode", "phrase"),
    [("ada:lovelace\n", 0o644, "readable by others"), ("ada\n", 0o600, "'user:password' lines"),
     ("", 0o600, "'user:password' lines"), (":secret\n", 0o600, "'user:password' lines")],
    ids=["readable by others", "no password", "empty", "no user"],
)
def test_bad_credentials_files_are_refused_naming_the_problem(tmp_path, text, mode, phrase):
    with pytest.raises(SettingsError, match=phrase):
        read_credentials(credentials(tmp_path, text, mode))


def test_uploads_go_to_a_private_folder_of_the_app(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)
    folder = keep_uploads_private(Settings(cache_dir=str(tmp_path / "cache")))
    assert os.environ["GRADIO_TEMP_DIR"] == str(folder) == str(tmp_path / "cache" / "uploads")
    assert folder.stat().st_mode & 0o777 == 0o700


def test_app_py_refuses_to_serve_beyond_this_machine_without_credentials_before_loading_a_model():
    done = subprocess.run([sys.executable, "app.py", "--ui-host", "0.0.0.0", "--model", "/nonexistent"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs credentials" in done.stderr and "/nonexistent" not in done.stderr
