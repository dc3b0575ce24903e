"""Failures as OpenAI's error objects, `{"error": {"message", "type", "param", "code"}}`, with the
status OpenAI gives them: 400 bad input, 401 a missing or wrong key, 404 an unknown model, 408 a
body too slow to come, 413 too large, 429 too many requests (or bodies) held, 500 a fault of the
server (logged, its details kept back), 503 a stream the server's shutdown cut (shutdown.py).

omni_local's own errors (`OmniLocalError`) are written for the person who sent the request, so
their message is passed on as it is.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omni_local.errors import OmniLocalError, UploadTooLarge

log = logging.getLogger(__name__)

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}
_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}  # the rest: "invalid_request_error"
# pydantic's error types that are worth saying otherwise
_PROBLEMS = {"json_invalid": "the request body is not valid JSON",
             "extra_forbidden": "this server does not know this field, and refuses it rather than ignore it"}


class ApiError(Exception):
    """A request refused with `status`: its message, the request field at fault, and OpenAI's code."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unknown_model(asked: str, served: str) -> ApiError:
    return ApiError(404, f"the model '{asked}' is not served here: this server serves '{served}'", "model_not_found",
                    "model")


def api_error(error: Exception) -> ApiError:
    """What the client is told of `error`, wherever it happened."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, UploadTooLarge):
        return ApiError(413, str(error), "request_too_large")
    if isinstance(error, OmniLocalError):
        return ApiError(400, str(error))
    log.exception("a request failed", exc_info=error)
    return ApiError(500, "the server failed to answer this request (its log says why)")


def place(location: tuple) -> str:
    """A field's place as OpenAI writes it, "messages[0].content[1].image_url.url", from pydantic's
    location of it, which also names the union members it tried ("str", "list[...]") and the tag of
    the content part it chose (the same word as the part's field, "image_url")."""
    names: list[str | int] = []
    for step in location:
        if isinstance(step, str) and (step in _TYPE_NAMES or "[" in step):
            continue
        if not names or step != names[-1]:
            names.append(step)
    return "".join(f"[{n}]" if isinstance(n, int) else f".{n}" for n in names).lstrip(".")


def add_error_handlers(api: FastAPI) -> None:
    """Every failure of `api`'s routes answered as an OpenAI error object."""

    async def known(request: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()

    async def http(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return ApiError(error.status_code, str(error.detail), code).response()

    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # The deepest problem (of a union, the member's that got furthest), at its place in the request.
        worst = max(error.errors(), key=lambda e: len(e["loc"]))
        at = place(worst["loc"][1:])  # after "body"
        problem = _PROBLEMS.get(worst["type"], worst["msg"])
        return ApiError(400, f"{at}: {problem}" if at else problem, param=at or None).response()

    api.add_exception_handler(ApiError, known)
    api.add_exception_handler(OmniLocalError, known)
    api.add_exception_handler(HTTPException, http)
    api.add_exception_handler(RequestValidationError, invalid)
    api.add_exception_handler(Exception, known)
