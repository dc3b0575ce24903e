"""`python -m omni_local serve`: the OpenAI-compatible API alone, at http://api_host:api_port/v1
(127.0.0.1:8000 by default). Beyond this machine only with `api_key_file` (access.py): that, and the
address being free, are checked before the model loads."""

import socket

import uvicorn
from starlette.applications import Starlette

from omni_local.access import api_key
from omni_local.api import OmniLocal
from omni_local.errors import SettingsError
from omni_local.server.routes import API_PATH, api_mount
from omni_local.settings import Settings

SHUTDOWN_GRACE_S = 5  # on Ctrl-C or SIGTERM, how long streams still open may take to end


def serve(settings: Settings) -> None:
    key = api_key(settings, "api_host")
    host, port = settings.api_host, settings.api_port
    with _listening(host, port) as listening, OmniLocal(settings, wait_for_graphs=False) as app:
        asgi = Starlette(routes=[api_mount(app, key)])
        # uvicorn's own start-up lines are left out: this one says where, and which model.
        config = uvicorn.Config(asgi, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        shown = f"[{host}]" if ":" in host else host
        print(f"omni_local serves the model '{app.info.model_id}' ({app.info.describe()}) at "
              f"http://{shown}:{port}{API_PATH}", flush=True)
        uvicorn.Server(config).run(sockets=[listening])


def _listening(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise SettingsError(f"cannot listen on {host} port {port} (api_host, api_port): "
                            f"{error.strerror or error}") from None
