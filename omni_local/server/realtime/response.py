"""One response of a realtime session: the backend's reply to the conversation, sent as OpenAI's
response events, its output added to the conversation as it comes.

A reply's text opens an assistant message item (spoken: an `output_audio` part, whose transcript is
the text; else an `output_text` part); each tool call the reply makes is a `function_call` item of
its own, its arguments sent whole in one delta (calls are read once their text is whole:
protocol/tool_calls.py). A spoken reply is spoken up to its first call, and that speech may still
be coming when the call is read: its calls wait for the reply's end, so its message item, closed
before them, holds all of its audio. Once the response is cancelled (`response.cancel`, or the user speaking
over it) nothing more of it is sent: the item keeps what the client was sent, and the engine's
`Finished`, which follows within a step, gives the usage.

`response.done` carries, besides OpenAI's fields, omni_local's own figure (as the chat API's replies
do): `omni_local.first_audio_ms`, from the moment the response was asked for (with server VAD, just
after `speech_stopped` was sent) to its first audio delta sent; None for a reply with no audio.
"""

import time
from collections.abc import Awaitable, Callable

import anyio

from omni_local.errors import OmniLocalError
from omni_local.media.pcm16 import base64_pcm16
from omni_local.protocol.backend import ReplyStream
from omni_local.protocol.events import AudioChunk, Finished, TextDelta
from omni_local.protocol.functions import ToolCall
from omni_local.server.realtime.client_events import EventError
from omni_local.server.realtime.conversation import Conversation, Item, SpokenText
from omni_local.server.realtime.server_events import error_event, new_id, server_event, usage
from omni_local.server.reply import ApiReply

Send = Callable[[dict], Awaitable[None]]
_STATUS = {"end_of_turn": "completed", "cancelled": "cancelled", "max_new_tokens": "incomplete",
           "context_full": "incomplete"}


class Response:
    def __init__(self, conversation: Conversation, spoken: bool, send: Send) -> None:
        self.id = new_id("resp")
        self.conversation = conversation
        self.spoken = spoken
        self.send = send
        self.output: list[Item] = []
        self.message: Item | None = None  # the reply's message item, while open
        self.cancelled_for: str | None = None  # why it was cancelled: "client_cancelled", "turn_detected"
        self._stream: ReplyStream | None = None
        self._asked_at = time.perf_counter()
        self._first_audio_ms: float | None = None
        self._calls: list[ToolCall] = []  # a spoken reply's, until its end

    def cancel(self, reason: str) -> None:
        if self.cancelled_for is None:
            self.cancelled_for = reason
            if self._stream is not None:
                self._stream.cancel()

    async def begin(self) -> None:
        await self.send(server_event("response.created", response=self.shape("in_progress")))

    async def stream(self, stream: ReplyStream, threads: anyio.CapacityLimiter) -> None:
        """Send the reply's events until its end, then `response.done`."""
        self._stream = stream
        if self.cancelled_for is not None:
            stream.cancel()  # cancelled while it was being queued
        final, failure = None, None
        try:
            async for event in ApiReply(stream, [], threads).events():
                if isinstance(event, Finished):
                    final = event
                elif self.cancelled_for is None:
                    await self._event(event)
        except OmniLocalError as error:
            failure = error
        await self.end(final, failure)

    async def end(self, final: Finished | None, failure: Exception | None = None) -> None:
        """Close the output and send `response.done` (failed, with an error event first, on `failure`)."""
        status = "failed" if failure is not None else _STATUS[final.stop_reason]
        if self.cancelled_for is not None:
            status = "cancelled"
        if isinstance(failure, EventError):
            await self.send(error_event(failure.message, failure.code, failure.param))
        elif failure is not None:  # the backend's: a prompt too long, a voice it lacks
            await self.send(error_event(str(failure), "response_failed"))
        if self.message is not None:
            whole = final is not None and final.text == self.message.text and not final.tool_calls
            self.message.token_ids = final.token_ids if whole else None
            await self._close_message("completed" if status == "completed" else "incomplete")
        if self.cancelled_for is None:
            for call in self._calls:
                await self._call(call)
        details = {"type": status}
        if self.cancelled_for is not None:
            details["reason"] = self.cancelled_for
        elif status == "incomplete":
            details["reason"] = "max_output_tokens"
        done = self.shape(status) | {"status_details": details}
        if final is not None:
            done["usage"] = usage(final)
        done["omni_local"] = {"first_audio_ms": self._first_audio_ms}
        await self.send(server_event("response.done", response=done))

    def shape(self, status: str) -> dict:
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": None,
                "output": [item.shape() for item in self.output], "conversation_id": "conv_default",
                "output_modalities": ["audio" if self.spoken else "text"], "usage": None}

    async def _event(self, event: object) -> None:
        if isinstance(event, ToolCall):
            if self.spoken:
                self._calls.append(event)
            else:
                await self._call(event)
            return
        text = event.text if isinstance(event, TextDelta) else ""
        audio = event.samples if isinstance(event, AudioChunk) and self.spoken else None
        if not text and (audio is None or not len(audio)):
            return
        await self._open_message()
        if self.cancelled_for is not None:
            return  # cancelled while the item was being opened: its text stays as the client has it
        if text:
            self.message.text += text
            kind = "response.output_audio_transcript.delta" if self.spoken else "response.output_text.delta"
            await self.send(server_event(kind, delta=text, **self._place()))
        else:
            if self._first_audio_ms is None:
                self._first_audio_ms = round((time.perf_counter() - self._asked_at) * 1000, 1)
            self.message.spoken.sent(len(audio), len(self.message.text))
            await self.send(server_event("response.output_audio.delta", delta=base64_pcm16(audio), **self._place()))

    async def _open_message(self) -> None:
        if self.message is not None:
            return
        self.message = Item(new_id("item"), "message", "assistant", status="in_progress", response_id=self.id,
                            spoken=SpokenText() if self.spoken else None)
        await self._added(self.message)
        part = {"type": "audio", "transcript": ""} if self.spoken else {"type": "text", "text": ""}
        await self.send(server_event("response.content_part.added", part=part, **self._place()))

    async def _close_message(self, status: str) -> None:
        message, place = self.message, self._place()
        self.message = None
        message.status = status
        if self.spoken:
            await self.send(server_event("response.output_audio.done", **place))
            await self.send(server_event("response.output_audio_transcript.done", transcript=message.text, **place))
            part = {"type": "audio", "transcript": message.text}
        else:
            await self.send(server_event("response.output_text.done", text=message.text, **place))
            part = {"type": "text", "text": message.text}
        await self.send(server_event("response.content_part.done", part=part, **place))
        await self._done(message)

    async def _call(self, call: ToolCall) -> None:
        if self.message is not None:
            await self._close_message("completed")
        item = Item(new_id("item"), "function_call", "assistant", call=call, response_id=self.id,
                    status="in_progress")
        await self._added(item)
        place = {"response_id": self.id, "item_id": item.id, "output_index": len(self.output) - 1,
                 "call_id": call.id}
        await self.send(server_event("response.function_call_arguments.delta", delta=call.arguments, **place))
        await self.send(server_event("response.function_call_arguments.done", arguments=call.arguments,
                                     name=call.name, **place))
        item.status = "completed"
        await self._done(item)

    async def _added(self, item: Item) -> None:
        previous = self.conversation.add(item)
        self.output.append(item)
        shape = item.shape()
        await self.send(server_event("response.output_item.added", response_id=self.id,
                                     output_index=len(self.output) - 1, item=shape))
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=shape))

    async def _done(self, item: Item) -> None:
        shape = item.shape()
        await self.send(server_event("response.output_item.done", response_id=self.id,
                                     output_index=self.output.index(item), item=shape))
        await self.send(server_event("conversation.item.done", item=shape))

    def _place(self) -> dict:
        return {"response_id": self.id, "item_id": self.message.id, "output_index": self.output.index(self.message),
                "content_index": 0}
