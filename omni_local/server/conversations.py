"""What a stateless API keeps between requests so that they still hit the prefix cache.

Each request carries the whole conversation. The prefix cache matches content, not ids, so a
conversation sent again (or another chat's same system prompt, of the same principal: access.py)
finds its KV whatever session it comes in. Two things would still miss, and are kept here:

- A reply's text, tokenized anew, may not give the ids the model made it of, and the KV cached
  for it matches only those. So each reply's text (as `reply_key` normalises it) maps to its token
  ids, and an assistant message whose text is a reply its principal was given is given them.
- A request continues a session: the one whose conversation and reply this request's history
  is, so the cache continues its entry in place (and its Talker KV, for spoken turns) instead of
  copying it into a new one. The map goes from the principal (access.py) and a digest of the
  conversation (roles, texts, media digests: a full BLAKE3 digest, never Python's `hash`) to the
  session's id, and a request takes the id out: one request at a time holds a session, and only its
  principal's. Anything else gets a fresh id.

Both maps are bounded, oldest out. Digesting a conversation's media is blocking work: it is done in
the server's worker threads, so the maps are shared under a lock.
"""

import json
import threading
from dataclasses import replace
import uuid
from collections import OrderedDict
from typing import Generic, TypeVar

import blake3
import numpy as np

from omni_local.media.digests import media_digest
from omni_local.media.video import VideoFile
from omni_local.protocol.events import Finished
from omni_local.protocol.messages import Message, reply_key

K, V = TypeVar("K"), TypeVar("V")
REMEMBERED_REPLIES = 4096  # token ids as int32: 4096 replies of 512 tokens are 8 MB
REMEMBERED_CONVERSATIONS = 4096


class BoundedMap(Generic[K, V]):
    """A dict of at most `size` entries; past that the least recently stored goes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def pop(self, key: K) -> V | None:
        return self._entries.pop(key, None)


class Conversations:
    def __init__(self) -> None:
        self._token_ids: BoundedMap[tuple[str, str], np.ndarray] = BoundedMap(REMEMBERED_REPLIES)
        self._sessions: BoundedMap[tuple[str, bytes], str] = BoundedMap(REMEMBERED_CONVERSATIONS)
        self._lock = threading.Lock()

    def continued(self, principal: str, messages: list[Message]) -> tuple[str, list[Message]]:
        """The session of `principal`'s to send `messages` (ending in the user's) in, and the messages
        with the token ids of each reply `principal` was given."""
        history = conversation_digest(messages[:-1])
        with self._lock:
            messages = [self._with_token_ids(principal, m) for m in messages]
            session = self._sessions.pop((principal, history))
        return session or uuid.uuid4().hex, messages

    def remember(self, principal: str, session: str, messages: list[Message], final: Finished) -> None:
        """`final` answered `messages` in `principal`'s `session`: the next turn of this conversation
        continues it."""
        reply = Message("assistant", [final.text], reasoning=final.reasoning, tool_calls=final.tool_calls)
        conversation = conversation_digest([*messages, reply])
        with self._lock:
            if final.token_ids is not None:
                key = principal, reply_key(final.text, final.reasoning)
                self._token_ids[key] = np.asarray(final.token_ids, np.int32)
            self._sessions[principal, conversation] = session

    def _with_token_ids(self, principal: str, message: Message) -> Message:
        # A reply that called tools is built anew from its calls (its ids are not remembered).
        if message.role != "assistant" or message.token_ids is not None or message.tool_calls:
            return message
        ids = self._token_ids.get((principal, reply_key(message.text, message.reasoning)))
        return message if ids is None else replace(message, token_ids=ids.tolist())


def conversation_digest(messages: list[Message]) -> bytes:
    """A digest of what the model sees of `messages`; a reply as one text, as `reply_key` has it."""
    hasher = blake3.blake3(b"omni_local conversation\0")
    for message in messages:
        parts = [reply_key(message.text, message.reasoning)] if message.role == "assistant" else message.parts
        hasher.update(f"{message.role}:{len(parts)}\0".encode())
        for call in message.tool_calls:
            hasher.update(json.dumps([call.id, call.name, call.arguments]).encode() + b"\0")
        if message.tool_call_id is not None:
            hasher.update(json.dumps(["result of", message.tool_call_id]).encode() + b"\0")
        for part in parts:
            if isinstance(part, str):
                text = part.encode("utf-8")
                hasher.update(b"text:%d\0" % len(text) + text)
            elif isinstance(part, VideoFile):  # a remote backend's video, sent on as its file
                hasher.update(b"video file:" + blake3.blake3(part.data).digest())
            else:
                hasher.update(b"medium:" + media_digest(part))
    return hasher.digest()
