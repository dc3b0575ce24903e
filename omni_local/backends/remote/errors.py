"""A remote server's failures as errors for people: the server's own message where it gave one,
and the server's address where the fault is in reaching it."""

import re
from typing import Any

import httpx
import openai

from omni_local.errors import OmniLocalError, RequestError

_BUSY = (429, 503)  # the server's queue is full, or it is not ready: worth trying again soon
_REFUSED_KEY = (401, 403)
_ERRNO = re.compile(r"\[Errno -?\d+\] ")  # "[Errno 111] Connection refused": the words are for people


def request_error(error: openai.APIStatusError, url: str) -> OmniLocalError:
    """An answer with an error status to a request: its OpenAI error object's message."""
    message = server_message(error)
    if error.status_code in _BUSY:
        return RequestError(f"the server at {url} is busy, try again in a moment ({message})")
    if error.status_code in _REFUSED_KEY:
        return RequestError(f"the server at {url} refused the API key (backend_api_key): {message}")
    if error.status_code >= 500:
        return RequestError(f"the server at {url} failed: {message}")
    return RequestError(message)  # bad input, said as the server says it


def unreachable(url: str, error: Exception) -> OmniLocalError:
    return OmniLocalError(f"cannot reach the server at {url} ({transport_cause(error)}): is it running? (backend_url)")


def lost_connection(url: str, error: Exception) -> OmniLocalError:
    return OmniLocalError(f"lost the connection to the server at {url} ({transport_cause(error)})")


def server_message(error: openai.APIStatusError) -> str:
    """The message in an error body: OpenAI's `{"error": {"message"}}` (the client has unwrapped it),
    vLLM's older `{"object": "error", "message"}`, or FastAPI's `{"detail"}`; else the status."""
    body: Any = error.body
    if isinstance(body, dict):
        message = body.get("message") or body.get("detail")
        if isinstance(message, str) and message:
            return message
    return f"HTTP {error.status_code} {error.response.reason_phrase}".strip()


def transport_cause(error: Exception) -> str:
    """What went wrong in reaching the server, in the transport's words."""
    cause = error.__cause__ if isinstance(error, openai.APIConnectionError) and error.__cause__ else error
    if isinstance(cause, httpx.TimeoutException):
        return "timed out"
    return _ERRNO.sub("", str(cause)) or type(cause).__name__
