"""One reply from a remote server, read as a stream of events, and stopped from any thread.

`cancel` marks the reply stopped and shuts the connection's socket down: the thread reading the
stream wakes at once (closing the socket alone would not wake a read already waiting on it), sees
the mark, and ends the reply with a `Finished` whose stop reason is "cancelled", as the local
engine's does. The server sees the connection go, and stops making the reply. Each reply has a
connection of its own (backend.py asks for `Connection: close`), so no other request is on the
socket that `cancel` shuts.
"""

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
from openai import Stream

from omni_local.backends.remote.chunks import ChunkReader
from omni_local.backends.remote.errors import lost_connection, request_error, unreachable
from omni_local.backends.remote.figures import Asked, ReplyTally, finished
from omni_local.errors import OmniLocalError, RequestError
from omni_local.protocol.events import AudioChunk, Event, ReasoningDelta, TextDelta
from omni_local.protocol.functions import ToolCall

OpenStream = Callable[[], Stream[Any]]  # sends the request; returns once the server answered


class RemoteReply:
    def __init__(self, open_stream: OpenStream, reader: ChunkReader, asked: Asked, url: str) -> None:
        self._open_stream, self._reader, self._asked, self._url = open_stream, reader, asked, url
        self._cancelled = threading.Event()
        self._lock = threading.Lock()  # the stream, between the reading thread and `cancel`
        self._stream: Stream[Any] | None = None
        self._read_to_the_end = False

    def events(self) -> Iterator[Event]:
        tally = ReplyTally()
        if not self._cancelled.is_set():
            for event in self._read():
                tally.add(event)
                yield event
        yield finished(self._asked, self._reader, tally, cancelled=not self._read_to_the_end)

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            if self._stream is not None and not self._stream.response.is_closed:
                _shut_down(self._stream.response)

    def _read(self) -> Iterator[TextDelta | ReasoningDelta | AudioChunk | ToolCall]:
        try:
            stream = self._open_stream()
        except openai.APIStatusError as error:
            raise request_error(error, self._url) from None
        except openai.APIConnectionError as error:
            raise unreachable(self._url, error) from None
        with self._lock:
            self._stream = stream
        try:
            if self._cancelled.is_set():  # cancelled while the request was sent: `cancel` saw no stream
                return
            for chunk in stream:
                if self._cancelled.is_set():
                    return
                yield from self._reader.read(chunk.to_dict())
            if self._cancelled.is_set():  # a shut socket can read as the stream's end
                return
            yield from self._reader.rest()
            self._read_to_the_end = True
        except (httpx.TransportError, openai.APIError, ValueError) as error:
            if not self._cancelled.is_set():  # else the socket was shut down under the read, as `cancel` meant
                raise _stream_error(error, self._url) from None
        finally:
            with self._lock:
                self._stream = None
            stream.close()


def _stream_error(error: Exception, url: str) -> OmniLocalError:
    if isinstance(error, httpx.TransportError):
        return lost_connection(url, error)
    if isinstance(error, openai.APIError):  # an error event in the stream: the server's message
        return RequestError(f"the server at {url} failed while replying: {error.message}")
    return OmniLocalError(f"the server at {url} sent a stream that is not OpenAI's chat API ({error})")


def _shut_down(response: httpx.Response) -> None:
    """Shut the response's socket down, if it has one (a test transport has none)."""
    network = response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the read has ended anyway
