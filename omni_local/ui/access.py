"""Who can reach the UI, and where uploads go.

By default the UI listens on 127.0.0.1 only. Serving beyond this machine is an explicit choice:
`ui_host` set to another address, and `ui_credentials_file` naming a private file (mode 0600) of
`user:password` lines, which Gradio then asks for. Uploads are kept in the app's own private
folder (`<cache_dir>/uploads`, mode 0700), not the system's shared temporary folder.
"""

import ipaddress
import os
from pathlib import Path
from typing import Any

from omni_local.cache.folders import private_folder
from omni_local.errors import SettingsError
from omni_local.settings import Settings


def keep_uploads_private(settings: Settings) -> Path:
    """Point Gradio's upload folder at the app's private one; call before Gradio is imported."""
    folder = private_folder(settings.cache_path / "uploads")
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder


def launch_options(settings: Settings) -> dict[str, Any]:
    """`launch()` arguments: the address, port and upload limit, and credentials when needed."""
    options: dict[str, Any] = {"server_name": settings.ui_host, "server_port": settings.ui_port,
                               "max_file_size": settings.max_upload_bytes}
    if settings.ui_credentials_file:
        options["auth"] = read_credentials(Path(settings.ui_credentials_file).expanduser())
    elif not is_loopback(settings.ui_host):
        raise SettingsError(
            f"serving beyond this machine (ui_host = '{settings.ui_host}') needs credentials: set "
            "ui_credentials_file to a private file (chmod 600) of 'user:password' lines"
        )
    return options


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def read_credentials(path: Path) -> list[tuple[str, str]]:
    try:
        mode = path.stat().st_mode
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise SettingsError(f"ui_credentials_file '{path}' cannot be read: {error.strerror}") from None
    if mode & 0o077:
        raise SettingsError(f"ui_credentials_file '{path}' is readable by others: make it private (chmod 600)")
    pairs = [tuple(line.split(":", 1)) for line in lines if line.strip()]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SettingsError(f"ui_credentials_file '{path}' must hold 'user:password' lines")
    return pairs
