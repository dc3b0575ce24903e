"""The socket a server listens on, bound before its model loads: a port in use (or an address not of
this machine) is one line naming the settings that chose it, not a traceback after minutes of loading."""

import os
import socket

from omni_local.errors import SettingsError


def listening(host: str, port: int, settings: str) -> socket.socket:
    """A socket listening on `host`:`port`; a `SettingsError` naming `settings` ("api_host, api_port")
    where it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        # create_server appends the address to strerror ("... (while attempting to bind on address
        # ('127.0.0.1', 8000))"); the message already says it.
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise SettingsError(f"cannot listen on {host} port {port} ({settings}): {reason}") from None
