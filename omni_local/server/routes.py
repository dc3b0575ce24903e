"""The API as an ASGI app, to mount at /v1: `POST /chat/completions` (completions.py), the realtime
WebSocket `/realtime` (realtime/), `GET /models` and `GET /models/{id}`, behind the admission checks
(admission.py), every failure an OpenAI error object (errors.py). `python -m omni_local serve` serves
it alone; `python app.py` with `ui_serves_api` beside the page, on the page's app and engine.

`/models` lists the one model served, with omni_local's own facts about it under `omni_local`:
{"speech", "voices", "max_prompt_tokens", "video", "runs_on", "model", "kind"} (`model`: its name as
the page's header shows it; `kind`: which member of the Qwen3-Omni family), and `max_model_len`
(prompt and reply, per request) as vLLM names it.
"""

import time

from fastapi import FastAPI
from starlette.routing import Mount

from omni_local.access import ApiKeys
from omni_local.api import OmniLocal
from omni_local.server.admission import Admission
from omni_local.server.completions import ChatCompletions
from omni_local.server.errors import add_error_handlers, unknown_model
from omni_local.server.realtime import RealtimeRoute

API_PATH = "/v1"


def api_mount(app: OmniLocal, keys: ApiKeys | None) -> Mount:
    """The API of `app` at /v1; clients must send one of `keys` if it is not None."""
    return Mount(API_PATH, app=api_app(app, keys))


def api_app(app: OmniLocal, keys: ApiKeys | None) -> FastAPI:
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(api)
    api.add_middleware(Admission, keys=keys, settings=app.settings)
    api.post("/chat/completions")(ChatCompletions(app).create)
    api.websocket("/realtime")(RealtimeRoute(app, app.settings.api_max_requests).connect)
    started = int(time.time())

    def model() -> dict:
        info = app.info
        facts = {"speech": info.speech, "voices": info.voices, "max_prompt_tokens": info.max_prompt_tokens,
                 "video": info.video, "runs_on": info.runs_on, "model": info.model, "kind": info.kind}
        return {"id": info.model_id, "object": "model", "created": started, "owned_by": "omni_local",
                "max_model_len": info.max_context_tokens, "omni_local": facts}

    @api.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model()]}

    @api.get("/models/{model_id:path}")
    async def one_model(model_id: str) -> dict:
        if model_id != app.info.model_id:
            raise unknown_model(model_id, app.info.model_id)
        return model()

    return api
