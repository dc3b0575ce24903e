"""Who may reach what this machine serves: the chat page and the API listen on 127.0.0.1 by
default; beyond it only with a secret kept in a private file (mode 0600): the page's credentials
(ui/access.py), the API's key (here). The page's credentials do not open the API: a client of the
API sends the key, `Authorization: Bearer KEY`."""

import ipaddress
from pathlib import Path

from omni_local.errors import SettingsError
from omni_local.settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def read_private_text(path: Path, setting: str) -> str:
    """The text of the file setting `setting` names, which must be closed to other users: it holds
    secrets."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SettingsError(f"{setting} '{path}' cannot be read: {error.strerror}") from None
    if mode & 0o077:
        raise SettingsError(f"{setting} '{path}' is readable by others: make it private (chmod 600)")
    return text


def api_key(settings: Settings, host_setting: str) -> str | None:
    """The key API clients must send, from `api_key_file`; None (no key asked) is allowed only on
    loopback. `host_setting` names the address the API listens on: `api_host` for `serve`, `ui_host`
    for the API beside the page."""
    host = getattr(settings, host_setting)
    if not settings.api_key_file:
        if not is_loopback(host):
            raise SettingsError(
                f"serving the API beyond this machine ({host_setting} = '{host}') needs a key: set api_key_file "
                "to a private file (chmod 600) holding it")
        return None
    path = Path(settings.api_key_file).expanduser()
    key = read_private_text(path, "api_key_file").strip()
    if not key or any(c.isspace() for c in key):
        raise SettingsError(f"api_key_file '{path}' must hold one key, a word without spaces")
    return key
