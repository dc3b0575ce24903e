"""omni_local's OpenAI-compatible API: `python -m omni_local serve`, or beside the chat page
(`ui_serves_api`). Any client of OpenAI's chat API (the `openai` SDK, Open WebUI, an editor plugin)
talks to the app's backend through it, and omni_local's own remote backend reads back every figure
a local reply has.

    routes.py         the ASGI app: /v1/chat/completions and /v1/models
    admission.py      key (401), body size (413), a body too slow (408), bodies and requests held
                      (429), before a route runs
    header_timeout.py connections closed whose request headers do not come in time
    schemas.py        the request's fields: each of OpenAI's read, accepted as harmless, or refused
    content.py        message content (text, data URLs of media) into omni_local's messages
    conversations.py  what a stateless API keeps so that requests still hit the prefix cache
    completions.py    a request sent to the backend, and its reply streamed or answered whole
    reply.py          the backend's blocking events read off the event loop, logprobs with their text
    stops.py          a reply's text cut at the request's stop strings, even across pieces
    shapes.py         a reply in OpenAI's shapes: chunks, or the completion (the wire format)
    figures.py        finish_reason, usage, and the `omni_local` figures object
    audio.py          speech as base64 PCM16 or WAV
    errors.py         failures as OpenAI error objects with their status
    shutdown.py       on Ctrl-C or SIGTERM, streams given a grace to end; the rest cut with an error
    serve.py          the `serve` command
"""
