"""`python app.py` as a user starts it, for the tests that meet the UI from outside (gradio_client,
a browser): a subprocess on a free 127.0.0.1 port, every setting on its command line. `serving`
runs any such server (`python -m omni_local serve` too: served_api.py)."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bad_files import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120
MAX_NEW_TOKENS = 24
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ServedApp:
    url: str
    process: subprocess.Popen
    cache_dir: Path
    log_path: Path

    def cpu_seconds(self) -> float:
        """CPU time the app has used so far, all its threads (Linux's /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


@contextlib.contextmanager
def served_app(demo_settings, root: Path, *extra: str) -> Iterator[ServedApp]:
    """`python app.py` with the tests' settings (and `extra` flags), its cache in `root`."""
    port = free_port()
    command = [
        sys.executable, "app.py", "--ui-port", str(port), "--demo-dir", demo_settings.demo_dir,
        "--cache-dir", str(root / "cache"), "--device", "cpu", "--max-image-pixels", str(MAX_IMAGE_PIXELS),
        "--max-audio-seconds", str(MAX_AUDIO_SECONDS), "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--speech", "true", "--max-speech-seconds", "1", *extra,
    ]
    url = f"http://127.0.0.1:{port}/"
    with serving(command, url, url, root / "cache", root / "app.log") as app:
        yield app


@contextlib.contextmanager
def serving(command: list[str], url: str, ready_url: str, cache_dir: Path, log_path: Path,
            headers: dict[str, str] | None = None) -> Iterator[ServedApp]:
    """`command` run from the repository until `ready_url` answers 200 (sent `headers`); ended after."""
    # A file, not a pipe: nobody reads the output while the app runs, and a full pipe would block it.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})  # this checkout's omni_local
    try:
        _wait_until_ready(urllib.request.Request(ready_url, headers=headers or {}), process, log_path)
        yield ServedApp(url, process, cache_dir, log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()  # reaped, not left a zombie


@contextlib.contextmanager
def running_app(demo_settings, root: Path, *extra: str) -> Iterator[str]:
    """`served_app`, for a test that needs only its URL."""
    with served_app(demo_settings, root, *extra) as app:
        yield app.url


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_ready(ready: urllib.request.Request, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{process.args[1:]} exited with status {process.returncode}:\n"
                        f"{log_path.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(ready, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{process.args[1:]} did not serve {ready.full_url} within {START_TIMEOUT_S} s:\n"
                f"{log_path.read_text(errors='replace')}")
