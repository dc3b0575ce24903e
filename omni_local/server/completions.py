"""`POST /v1/chat/completions`: a request's conversation sent to the app's backend, and its reply
streamed back (server-sent events) or answered whole. The shapes are in shapes.py.

A failure is known before the response starts wherever it can be: the reply's first event (its
first text, or its failure: an over-long prompt, a corrupt image) is waited for before the headers
go, so such failures get their real status. Only a failure after that is an event in the stream.
A client that goes away, streaming or not, cancels its reply. A stream the server's shutdown cuts
ends with an error event (shutdown.py).
"""

import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
import numpy as np
from anyio import to_thread
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omni_local.access import within
from omni_local.api import OmniLocal
from omni_local.protocol.events import AudioChunk, Event, Finished
from omni_local.protocol.functions import ToolCall
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SpeechParams
from omni_local.server.admission import PRINCIPAL
from omni_local.server.content import ContentReader
from omni_local.server.conversations import Conversations
from omni_local.server.errors import ApiError, api_error, unknown_model
from omni_local.server.reply import ApiReply
from omni_local.server.schemas import ChatRequest
from omni_local.server.shapes import ReplyShapes
from omni_local.server.shutdown import Draining, ShuttingDown
from omni_local.server.tools import tool_use

T = TypeVar("T")
CLIENT_GONE = 499  # nginx's status for a client that closed the connection: nobody reads it


class ChatCompletions:
    """The route's handler, with what it keeps across requests: the conversations, and the threads."""

    def __init__(self, app: OmniLocal) -> None:
        self.app = app
        self.content = ContentReader(app.limits, app.read_video, app.settings.api_local_files)
        self.conversations = Conversations()
        # Each request held waits in at most one thread at a time (decoding its media, or for its next event).
        self.threads = anyio.CapacityLimiter(app.settings.api_max_requests)
        self.draining = Draining(app.settings.shutdown_grace_s)

    async def create(self, body: ChatRequest, request: Request) -> Response:
        self._check(body)
        params = self.app.sampling(**body.sampling())
        speech = self._speech(body) if body.speaks else None
        principal = within(request.scope[PRINCIPAL], body.prompt_cache_key)  # whose request: the key's holder
        tools = tool_use(body)
        session, messages = await to_thread.run_sync(self._conversation, body, principal, limiter=self.threads)
        stream = await to_thread.run_sync(self.app.backend.send, session, messages, params, speech, principal, tools,
                                          limiter=self.threads)
        reply = ApiReply(stream, body.stops, self.threads)
        events = reply.events()
        shapes = ReplyShapes(self.app.info.model_id, body.speaks, body.include_usage, bool(body.logprobs))
        try:
            if not body.stream:
                speech_samples = await unless_disconnected(request, _whole_speech(events))
                if speech_samples is None:
                    return Response(status_code=CLIENT_GONE)
                await self._remember(principal, session, messages, reply.final)
                return JSONResponse(shapes.completion(reply.final, speech_samples, body.audio_format,
                                                      reply.logprobs))
            first = await unless_disconnected(request, anext(events))
        except BaseException:
            await events.aclose()
            raise
        if first is None:
            await events.aclose()
            return Response(status_code=CLIENT_GONE)
        return self.draining.respond(reply, self._sse(first, events, shapes, principal, session, messages))

    def _check(self, body: ChatRequest) -> None:
        model = self.app.info.model_id
        if body.model != model:
            raise unknown_model(body.model, model)
        refused = body.unsupported()
        if refused is not None:
            field, why = refused
            raise ApiError(400, f"{field}: {why}", param=field)
        if body.speaks and body.stream and body.audio_format != "pcm16":
            raise ApiError(400, f"streamed audio is pcm16: ask for audio.format 'pcm16' with stream true, not "
                           f"'{body.audio_format}'", param="audio.format")

    def _conversation(self, body: ChatRequest, principal: str) -> tuple[str, list[Message]]:
        """The request's messages decoded, and the session of `principal`'s they continue (blocking
        work: media)."""
        return self.conversations.continued(principal, self.content.conversation(body.messages))

    async def _remember(self, principal: str, session: str, messages: list[Message], final: Finished) -> None:
        await to_thread.run_sync(self.conversations.remember, principal, session, messages, final,
                                 limiter=self.threads)

    def _speech(self, body: ChatRequest) -> SpeechParams:
        """The spoken reply asked for: in the request's voice, else the `voice` setting's."""
        given = body.audio.voice if body.audio is not None else None
        temperature = SpeechParams.temperature if body.talker_temperature is None else body.talker_temperature
        return SpeechParams(given or self.app.settings.voice, temperature=temperature)

    async def _sse(self, first: Event, events: AsyncIterator[Event], shapes: ReplyShapes, principal: str,
                   session: str, messages: list[Message]) -> AsyncIterator[str]:
        try:
            async for event in _after(first, events):
                for chunk in _chunks(event, shapes):
                    yield json.dumps(chunk)
                if isinstance(event, Finished):
                    await self._remember(principal, session, messages, event)
            yield "[DONE]"
        except ShuttingDown as cut:
            yield json.dumps(shapes.cut_chunk())
            yield json.dumps(cut.body())
        except Exception as error:  # noqa: BLE001 - the stream has begun: the error goes in it
            yield json.dumps(api_error(error).body())
        finally:
            await events.aclose()


async def _after(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    async for event in events:
        yield event


def _chunks(event: Event, shapes: ReplyShapes) -> list[dict]:
    if isinstance(event, ToolCall):
        return shapes.tool_call_chunks(event)
    return shapes.last_chunks(event) if isinstance(event, Finished) else [shapes.chunk(event)]


async def _whole_speech(events: AsyncIterator[Event]) -> np.ndarray:
    """The whole reply read; its speech's samples (empty if none)."""
    pieces = [event.samples async for event in events if isinstance(event, AudioChunk)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (`work` cancelled) once the client has closed the connection."""
    result, failure = None, None
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work
        except Exception as error:  # noqa: BLE001 - raised as it is below, not in a task group's ExceptionGroup
            failure = error
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result
