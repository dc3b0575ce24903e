"""The server's events, shaped as OpenAI's Realtime API (GA) sends them: each with its own event id,
and the error event that answers a client event refused."""

import secrets

from omni_local.protocol.events import Finished


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: "item_…", "resp_…", "event_…"."""
    return f"{prefix}_{secrets.token_hex(10)}"


def server_event(kind: str, **fields: object) -> dict:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(message: str, code: str | None = None, param: str | None = None, event_id: str | None = None,
                kind: str = "invalid_request_error") -> dict:
    """`event_id`: the id of the client event at fault, if it gave one."""
    return server_event("error", error={"type": kind, "code": code, "message": message, "param": param,
                                        "event_id": event_id})


def usage(final: Finished) -> dict:
    """A reply's token counts as a response's usage: `cached_tokens` are the prompt's tokens whose KV
    the prefix cache gave (the conversation's earlier turns, reused)."""
    prompt, generated = final.tokens.prompt or 0, final.tokens.generated or 0
    return {"total_tokens": prompt + generated, "input_tokens": prompt, "output_tokens": generated,
            "input_token_details": {"cached_tokens": final.tokens.reused or 0},
            "output_token_details": {}}
