"""A port already in use, for the page (`python app.py`) and the API server (`serve`): one line
naming the settings to change and exit status 2, before any model loads; never a traceback."""

import socket
import subprocess
import sys

import pytest

from served_app import REPO, free_port


@pytest.fixture
def taken_port():
    """A port of 127.0.0.1 that another program listens on."""
    with socket.create_server(("127.0.0.1", free_port())) as taken:
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("command", "settings"),
    [(["app.py", "--ui-port"], "ui_host, ui_port"),
     (["-m", "omni_local", "serve", "--api-port"], "api_host, api_port")],
    ids=["app.py", "serve"],
)
def test_a_port_in_use_is_one_line_and_status_2_before_the_model_loads(demo_settings, taken_port, command, settings):
    done = subprocess.run([sys.executable, *command, str(taken_port), "--demo-dir", demo_settings.demo_dir,
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (
        2, f"error: cannot listen on 127.0.0.1 port {taken_port} ({settings}): Address already in use\n")
    assert "omni_local" not in done.stdout  # no start-up line: the model was never loaded
