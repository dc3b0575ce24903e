"""The prefix cache: each chat session's KV, kept so that its next turn, or another session that
starts the same way, computes only what is new.

An entry is one session's sequence: the keys of the tokens whose KV is written (published only after
the compute that fills them), where that KV is (a KV slot on the device, or host memory), and the
digests of its media. A new prompt is matched against every entry: the longest common prefix of
keys, cut so that it never ends inside an image or a clip, verified medium by medium by full digest,
and always leaving the last prompt token to compute (its logits pick the first reply token). The
session's own entry is continued in place; another entry's prefix is copied, so no session's later
writes change what another reads.

Memory: KV slots on the device are the first tier; when none is free, the least recently used entry
that no running request holds moves to host memory (the second tier, its own byte budget) and comes
back on a hit; past that budget the oldest host entries are dropped.
"""

import itertools
from dataclasses import dataclass

import numpy as np

from omni_local.engine.kv_store import HostCopy, KVStore
from omni_local.prompts import Prompt


@dataclass
class Entry:
    session: str
    keys: np.ndarray  # [n] keys of the tokens whose KV is written, in order
    media: dict[int, bytes]  # start -> full digest, for every medium in `keys`
    kv_slot: int | None = None  # where the KV is: a KV slot on the device ...
    host: HostCopy | None = None  # ... or host memory
    pins: int = 0  # running requests that read or write it
    last_used: int = 0

    @property
    def length(self) -> int:
        return len(self.keys)

    def __post_init__(self) -> None:
        assert (self.kv_slot is None) != (self.host is None), "an entry lives in exactly one tier"


@dataclass(frozen=True)
class Match:
    entry: Entry | None
    length: int  # prompt tokens whose KV comes from `entry`


@dataclass
class Claim:
    """What a request holds while it runs: its session's entry, in a KV slot."""

    entry: Entry
    start: int  # rows already valid: the request computes from here
    reused_gpu: int
    reused_host: int


class PrefixCache:
    def __init__(self, kv: KVStore, host_budget_bytes: int, enabled: bool) -> None:
        self.kv = kv
        self.host_budget = host_budget_bytes
        self.enabled = enabled
        self.entries: dict[str, Entry] = {}
        self._clock = itertools.count(1)

    # Accounting -----------------------------------------------------------------------------

    @property
    def token_bytes(self) -> int:
        return self.kv.shape.token_bytes(self.kv.dtype)

    @property
    def gpu_bytes(self) -> int:
        """Device bytes of cached KV: at most the store's allocation, which is the budget."""
        return sum(e.length for e in self.entries.values() if e.kv_slot is not None) * self.token_bytes

    @property
    def host_bytes(self) -> int:
        return sum(e.host.nbytes for e in self.entries.values() if e.host is not None)

    # The request's life: match, claim, publish, release ---------------------------------------

    def match(self, prompt: Prompt) -> Match:
        """The entry sharing the longest verified prefix with `prompt` (never its last token)."""
        if not self.enabled:
            return Match(None, 0)
        best = Match(None, 0)
        for entry in self.entries.values():
            length = _verified_prefix(entry, prompt)
            better = length > best.length or (length == best.length and length and entry.kv_slot is not None
                                              and best.entry.kv_slot is None)
            if better:
                best = Match(entry, length)
        return best

    def claim(self, session: str, prompt: Prompt, match: Match) -> Claim | None:
        """A KV slot for `session` holding the matched prefix, or None if every KV slot is held by a
        running request (the request then waits). The session's entry is pinned until `release`."""
        own = self.entries.get(session)
        kv_slot = self._kv_slot_for(own, keep=match.entry)
        if kv_slot is None and match.entry is not None:
            # Only the match's own source can make room (one KV slot, say): let it move, then match
            # again, now against wherever it went (host memory, or nowhere).
            kv_slot = self._kv_slot_for(own, keep=None)
            if kv_slot is not None:
                match = self.match(prompt)
        if kv_slot is None:
            return None
        reused_gpu = reused_host = 0
        source = match.entry
        if source is not None and match.length:
            if source.kv_slot is not None:
                if source.kv_slot != kv_slot:
                    self.kv.copy_rows(source.kv_slot, kv_slot, match.length)
                reused_gpu = match.length
            else:
                self.kv.from_host(source.host, kv_slot, match.length)
                reused_host = match.length
            source.last_used = next(self._clock)
        if own is not None and own.kv_slot is None:
            own.host = None  # replaced by the state this request starts from
        keys = prompt.keys[: match.length].copy()
        media = {m.start: m.digest for m in prompt.media if m.end <= match.length}
        entry = Entry(session, keys, media, kv_slot=kv_slot, pins=1, last_used=next(self._clock))
        self.entries[session] = entry
        return Claim(entry, match.length, reused_gpu, reused_host)

    def publish(self, claim: Claim, prompt: Prompt, reply: list[int], written: int) -> None:
        """The KV of the first `written` tokens of prompt-then-reply is in its KV slot now."""
        entry = claim.entry
        if written <= prompt.num_tokens:
            entry.keys = prompt.keys[:written].copy()
        else:
            entry.keys = np.concatenate([prompt.keys, np.asarray(reply[: written - prompt.num_tokens], np.int64)])
        entry.media = {m.start: m.digest for m in prompt.media if m.end <= written}

    def release(self, claim: Claim) -> None:
        entry = claim.entry
        entry.pins -= 1
        assert entry.pins >= 0
        entry.last_used = next(self._clock)
        if not self.enabled and entry.pins == 0:
            self._drop(entry)

    def discard(self, claim: Claim) -> None:
        """Release `claim` and forget what its request wrote: its outputs were not numbers, so its
        rows must reach no attention again. The KV slot's rows are zeroed and the session's entry is
        dropped (its next turn starts afresh). No other entry holds a copy of them: a request
        publishes its prompt's rows only once its first token's logits are checked, and its
        reply's only when it ends."""
        entry = claim.entry
        entry.pins -= 1
        assert entry.pins == 0, "a session's entry is held by one request at a time"
        self._drop(entry, scrub=True)

    # Memory ---------------------------------------------------------------------------------

    def make_room(self) -> None:
        """Free one KV slot ahead of need, so moving an entry to host memory (a copy of all its
        KV) is not paid inside the next request's time to first token."""
        if self.kv.free_slots == 0:
            victim = self._least_recent_on_device(keep=None)
            if victim is not None:
                self._move_to_host(victim, keep=None)

    def _kv_slot_for(self, own: Entry | None, keep: Entry | None) -> int | None:
        """A free KV slot; `keep` (the match's source) is neither moved nor dropped meanwhile."""
        if own is not None and own.kv_slot is not None:
            if own.pins:
                return None  # the session's previous request still runs in it
            return own.kv_slot  # continued in place: rows past the match are rewritten
        kv_slot = self.kv.allocate()
        while kv_slot is None:
            victim = self._least_recent_on_device(keep)
            if victim is None:
                return None
            self._move_to_host(victim, keep)
            kv_slot = self.kv.allocate()
        return kv_slot

    def _least_recent_on_device(self, keep: Entry | None) -> Entry | None:
        candidates = [e for e in self.entries.values() if e.kv_slot is not None and e.pins == 0 and e is not keep]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def _move_to_host(self, entry: Entry, keep: Entry | None) -> None:
        size = entry.length * self.token_bytes
        while self.host_bytes + size > self.host_budget and self._drop_oldest_on_host(keep):
            pass
        if entry.length and self.host_bytes + size <= self.host_budget:
            entry.host = self.kv.to_host(entry.kv_slot, entry.length)
            self.kv.release(entry.kv_slot)
            entry.kv_slot = None
        else:
            self._drop(entry)

    def _drop_oldest_on_host(self, keep: Entry | None) -> bool:
        on_host = (e for e in self.entries.values() if e.host is not None and e is not keep)
        oldest = min(on_host, key=lambda e: e.last_used, default=None)
        if oldest is None:
            return False
        self._drop(oldest)
        return True

    def _drop(self, entry: Entry, scrub: bool = False) -> None:
        if entry.kv_slot is not None:
            self.kv.release(entry.kv_slot, scrub=scrub)
        entry.kv_slot, entry.host = None, None
        if self.entries.get(entry.session) is entry:
            del self.entries[entry.session]


def _verified_prefix(entry: Entry, prompt: Prompt) -> int:
    return common_prefix(entry.keys, entry.media, prompt, min(entry.length, prompt.num_tokens - 1))


def common_prefix(keys: np.ndarray, media: dict[int, bytes], prompt: Prompt, limit: int) -> int:
    """How many of `prompt`'s first `limit` tokens a sequence of `keys`, with `media` (start -> full
    digest), shares: never ending inside a medium, and each medium before the end verified by its
    full digest."""
    differs = np.flatnonzero(keys[:limit] != prompt.keys[:limit])
    length = int(differs[0]) if differs.size else limit
    for item in prompt.media:
        if item.start >= length:
            break
        if item.end > length or media.get(item.start) != item.digest:
            return item.start  # never inside a medium, and only a medium whose full digest agrees
    return length
