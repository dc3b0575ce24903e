"""One realtime session: one chat of the engine, driven by the client's events.

The session's conversation is the chat's history; every response sends it all, under the session's
one chat id, so the engine continues the chat's KV in place and the prefix cache reuses each earlier
turn (the usage's `cached_tokens`). One response runs at a time. Speech that starts while a response
runs cancels it (server VAD's `interrupt_response`); the next response waits for the cancelled one's
end, so the conversation holds its item before the new turn's prompt is built.
"""

import asyncio
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
from anyio import to_thread

from omni_local.api import OmniLocal
from omni_local.errors import OmniLocalError
from omni_local.media import SAMPLE_RATE
from omni_local.media.audio import check_duration, check_samples
from omni_local.protocol.params import SpeechParams
from omni_local.server.realtime.client_events import (AudioAppend, AudioClear, AudioCommit, ClientEvent, EventError,
                                                      ItemCreate, ItemDelete, ItemTruncate, MessageItem,
                                                      ResponseCancel, ResponseCreate, ResponseFields, SessionUpdate)
from omni_local.server.realtime.config import SessionConfig
from omni_local.server.realtime.conversation import Conversation, Item
from omni_local.server.realtime.input_audio import InputAudio, SpeechStart, SpeechStop, decode_pcm16, to_16k
from omni_local.server.realtime.response import Response
from omni_local.server.realtime.server_events import new_id, server_event

Send = Callable[[dict], Awaitable[None]]


class RealtimeSession:
    def __init__(self, app: OmniLocal, principal: str, send: Send, threads: anyio.CapacityLimiter) -> None:
        self.app, self.principal, self.send, self.threads = app, principal, send, threads
        self.id = new_id("sess")  # the engine's chat id: the prefix cache continues its entry
        self.config = SessionConfig.default(app.info, app.settings.voice)
        self.conversation = Conversation()
        self.audio: InputAudio | None = None  # made by `begin`: loading the VAD is blocking work
        self.response: Response | None = None
        self._task: asyncio.Task | None = None
        self._next_item = new_id("item")  # the id the buffer's audio gets once committed

    async def begin(self) -> None:
        self.audio = await to_thread.run_sync(InputAudio, self.config.turn_detection,
                                              self.app.settings.max_audio_seconds, limiter=self.threads)
        await self.send(server_event("session.created", session=self._shape()))

    async def handle(self, event: ClientEvent) -> None:
        handler = _HANDLERS[type(event)]
        await handler(self, event)

    async def close(self) -> None:
        """The client is gone: its response is cancelled, and the engine stops making it."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _shape(self) -> dict:
        return {"id": self.id, **self.config.shape()}

    async def _update(self, event: SessionUpdate) -> None:
        before = self.config.turn_detection
        self.config = self.config.updated(event.session, self.app.info)
        if self.config.turn_detection != before:
            await to_thread.run_sync(self.audio.detect, self.config.turn_detection, limiter=self.threads)
        await self.send(server_event("session.updated", session=self._shape()))

    async def _append(self, event: AudioAppend) -> None:
        samples = decode_pcm16(event.audio)
        for found in await to_thread.run_sync(self.audio.append, samples, limiter=self.threads):
            if isinstance(found, SpeechStart):
                await self._speech_started(found)
            else:
                await self._speech_stopped(found)

    async def _speech_started(self, start: SpeechStart) -> None:
        vad = self.config.turn_detection
        if vad.interrupt_response and self.response is not None:
            self.response.cancel("turn_detected")
        await self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=start.audio_start_ms,
                                     item_id=self._next_item))

    async def _speech_stopped(self, stop: SpeechStop) -> None:
        await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=stop.audio_end_ms,
                                     item_id=self._next_item))
        await self._commit_audio(stop.samples)
        if self.config.turn_detection.create_response:
            await self._respond(None)

    async def _commit(self, event: AudioCommit) -> None:
        await self._commit_audio(self.audio.take())

    async def _commit_audio(self, samples: np.ndarray) -> None:
        item = Item(self._next_item, "message", "user", audio=self._checked(samples, "the input audio buffer"))
        self._next_item = new_id("item")
        previous = self.conversation.add(item)
        await self.send(server_event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous))
        await self._item_added(item, previous)

    def _checked(self, samples: np.ndarray, what: str) -> np.ndarray:
        try:
            check_samples(what, samples, "the audio")
            check_duration(what, len(samples) / SAMPLE_RATE, self.app.limits)
        except OmniLocalError as error:
            raise EventError(str(error), "invalid_audio") from None
        return samples

    async def _clear(self, event: AudioClear) -> None:
        self.audio.clear()
        await self.send(server_event("input_audio_buffer.cleared"))

    async def _create_item(self, event: ItemCreate) -> None:
        given = event.item
        item_id = given.id or new_id("item")
        if isinstance(given, MessageItem):
            item = self._message(given, item_id)
        else:
            calls = {known.call.id for known in self.conversation.items if known.type == "function_call"}
            if given.call_id not in calls:
                raise EventError(f"no function call in the conversation has the call_id {given.call_id!r}",
                                 param="item.call_id")
            item = Item(item_id, "function_call_output", "tool", text=given.output, call_id=given.call_id)
        await self._item_added(item, self.conversation.add(item))

    def _message(self, given: MessageItem, item_id: str) -> Item:
        allowed = {"user": ("input_text", "input_audio"), "assistant": ("output_text", "output_audio")}[given.role]
        text, audio = "", []
        for index, part in enumerate(given.content):
            if part.type not in allowed:
                raise EventError(f"a {given.role} message holds {', '.join(allowed)} parts, not {part.type}",
                                 param=f"item.content[{index}].type")
            if part.type == "input_audio":
                audio.append(to_16k(decode_pcm16(part.audio or "", f"item.content[{index}].audio")))
            # A reply's transcript is its text; a user's audio is heard as it is, whatever its transcript says.
            text += part.text or (part.transcript if part.type == "output_audio" else None) or ""
        samples = self._checked(np.concatenate(audio), "item.content") if audio else None
        return Item(item_id, "message", given.role, text=text, audio=samples)

    async def _item_added(self, item: Item, previous: str | None) -> None:
        shape = item.shape()
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=shape))
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=shape))

    async def _truncate(self, event: ItemTruncate) -> None:
        if event.content_index != 0:
            raise EventError("a reply has one content part: content_index must be 0", param="content_index")
        item = self.conversation.find(event.item_id)
        # A client truncates as soon as it hears speech over the reply, before the cancelled response's
        # end: a cancelled response adds nothing more to its item, so only a running one's is refused.
        running = self.response is not None and self.response.cancelled_for is None
        if running and item.response_id == self.response.id:
            raise EventError(f"item {item.id} is still being made: cancel its response first", param="item_id")
        item.truncate(event.audio_end_ms)
        await self.send(server_event("conversation.item.truncated", item_id=item.id, content_index=0,
                                     audio_end_ms=event.audio_end_ms))

    async def _delete(self, event: ItemDelete) -> None:
        self.conversation.remove(event.item_id)
        await self.send(server_event("conversation.item.deleted", item_id=event.item_id))

    async def _create_response(self, event: ResponseCreate) -> None:
        await self._respond(event.response)

    async def _cancel(self, event: ResponseCancel) -> None:
        if self.response is None or (event.response_id and event.response_id != self.response.id):
            raise EventError("there is no response in progress to cancel", "response_cancel_not_active")
        self.response.cancel("client_cancelled")

    async def _respond(self, fields: ResponseFields | None) -> None:
        """Start a response to the conversation, after the one being cancelled, if any."""
        if self.response is not None and self.response.cancelled_for is None:
            raise EventError(f"the conversation already has a response in progress ({self.response.id})",
                             "conversation_already_has_active_response")
        config = self.config if fields is None else self.config.updated(fields, self.app.info)
        response = Response(self.conversation, config.modality == "audio", self.send)
        previous, self.response = self._task, response
        self._task = asyncio.create_task(self._run(previous, response, config))

    async def _run(self, previous: asyncio.Task | None, response: Response, config: SessionConfig) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            await response.begin()
            if not self.conversation.last_asks():
                await response.end(None, EventError("the conversation ends in no user message nor function "
                                                    "call output to answer", "nothing_to_answer"))
                return
            params = self.app.sampling(**({} if config.max_output_tokens is None
                                          else {"max_new_tokens": config.max_output_tokens}))
            speech = SpeechParams(config.voice) if response.spoken else None
            messages = self.conversation.messages(config.instructions)
            try:
                stream = await to_thread.run_sync(self.app.backend.send, self.id, messages, params, speech,
                                                  self.principal, config.tool_use(), limiter=self.threads)
            except (OmniLocalError, EventError) as error:
                await response.end(None, error)
                return
            await response.stream(stream, self.threads)
        finally:
            if self.response is response:
                self.response = None


_HANDLERS = {SessionUpdate: RealtimeSession._update, AudioAppend: RealtimeSession._append,
             AudioCommit: RealtimeSession._commit, AudioClear: RealtimeSession._clear,
             ItemCreate: RealtimeSession._create_item, ItemTruncate: RealtimeSession._truncate,
             ItemDelete: RealtimeSession._delete, ResponseCreate: RealtimeSession._create_response,
             ResponseCancel: RealtimeSession._cancel}
