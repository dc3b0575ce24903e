"""`python -m omni_local serve`: the OpenAI-compatible API alone, at http://api_host:api_port/v1
(127.0.0.1:8000 by default). Beyond this machine only with `api_key_file` (access.py): that, and the
address being free, are checked before the model loads. It answers to the names of hosts.py."""

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

from omni_local.access import api_keys
from omni_local.api import OmniLocal
from omni_local.server.hosts import HostCheck, ServedNames
from omni_local.listening import listening
from omni_local.server.header_timeout import timing_out_headers
from omni_local.server.routes import API_PATH, api_mount
from omni_local.server.shutdown import MARGIN_S
from omni_local.settings import Settings


def serve(settings: Settings) -> None:
    keys = api_keys(settings, "api_host")
    names = ServedNames(settings.api_host, settings.allowed_hosts)
    host, port = settings.api_host, settings.api_port
    with listening(host, port, "api_host, api_port") as bound, OmniLocal(settings, wait_for_graphs=False) as app:
        asgi = Starlette(routes=[api_mount(app, keys)], middleware=[Middleware(HostCheck, names=names)])
        # uvicorn's own start-up lines are left out: this one says where, and which model.
        config = uvicorn.Config(asgi, log_level="warning", http=timing_out_headers(settings.header_timeout_s),
                                timeout_graceful_shutdown=settings.shutdown_grace_s + MARGIN_S)
        shown = f"[{host}]" if ":" in host else host
        print(f"omni_local serves the model '{app.info.model_id}' ({app.info.describe()}) at "
              f"http://{shown}:{port}{API_PATH}", flush=True)
        uvicorn.Server(config).run(sockets=[bound])
