"""The prefix cache: each chat session's KV, kept so that its next turn, or another session that
starts the same way, computes only what is new.

An entry is one session's sequence: the keys of the tokens whose KV is written (published only after
the compute that fills them), where that KV is (a block table on the device, or host memory), and the
digests of its media. A new prompt is matched two ways, and the longer match is taken:
- against every entry: the longest common prefix of keys, cut so that it never ends inside an image
  or a clip, verified medium by medium by full digest;
- by its full blocks' chained hashes (kv_blocks.py), which also finds the blocks of entries moved to
  host memory or dropped, while nobody has been handed them since.
Either way the last prompt token is always left to compute (its logits pick the first reply token).
Both ways see only the asking principal's KV (access.py: an API key's holder, a page's user): its
own entries, and blocks whose chain begins with its salt. Another's prompt is neither reused nor
reported (as cached tokens, or as a faster first token), while one principal's chats share.

A claim builds the request's table: the matched prefix's full blocks are shared (held once more,
never written: the request writes only rows after its start), a partly matched last block is copied
to a block of its own unless the session's own entry alone holds it (then it is continued in place),
and fresh blocks follow for the rows the engine asks for (its prompt and the start of its reply);
`grow` adds blocks as the reply outgrows them. A request that can never fit fails at once. A running
request the engine preempts is parked: its rows go to host memory (never dropped, beyond the arena
if need be), and its blocks back to the pool, until `resume` puts them in fresh blocks; its claim
stays meanwhile.

Memory: the device's blocks are the first tier; when too few are free, the least recently used entry
that no running request holds moves to host memory (the second tier: an arena of blocks allocated at
start-up, host_arena.py) and comes back on a hit; when the arena is full the oldest host entries
are dropped. A block another entry shares stays on the device with it. The copies are queued on a
copy stream: nobody waits for a move to host, but its blocks are held until it has run (`settle`
gives them back), and only a request that needs those very blocks waits for it; a request whose
rows come back from host memory is `ready` once they are there.
"""

import itertools
from dataclasses import dataclass

import numpy as np

from omni_local.access import LOCAL_USER, principal_salt
from omni_local.engine.memory.host_arena import HostArena, HostBlocks, Transfer
from omni_local.engine.memory.kv_blocks import PAD_BLOCK, chain
from omni_local.engine.memory.kv_store import BlockTable, HostCopy, KVStore
from omni_local.engine.prompt.builder import Prompt
from omni_local.errors import RequestError


@dataclass
class Entry:
    principal: str  # whose: only this principal's requests match it
    session: str
    keys: np.ndarray  # [n] keys of the tokens whose KV is written, in order
    media: dict[int, bytes]  # start -> full digest, for every medium in `keys`
    table: BlockTable | None = None  # where the KV is: blocks on the device (held by the entry) ...
    host: HostBlocks | HostCopy | None = None  # ... or host memory: the arena's, or a parked request's copy
    pins: int = 0  # running requests that read or write it
    last_used: int = 0
    registered: int = 0  # its first blocks registered by hash

    @property
    def length(self) -> int:
        return len(self.keys)

    @property
    def owner(self) -> tuple[str, str]:
        """Its key among the cache's entries: sessions are named by their principals."""
        return self.principal, self.session

    def __post_init__(self) -> None:
        assert (self.table is None) != (self.host is None), "an entry lives in exactly one tier"


@dataclass(frozen=True)
class Match:
    entry: Entry | None  # the entry whose rows are reused; None with `blocks` found by hash, or nothing
    length: int  # prompt tokens whose KV comes from `entry` or `blocks`
    blocks: tuple[int, ...] = ()

    @property
    def on_device(self) -> bool:
        return bool(self.blocks) or (self.entry is not None and self.entry.table is not None)


@dataclass
class Claim:
    """What a request holds while it runs: its session's entry, with blocks for all it may write."""

    entry: Entry
    start: int  # rows already valid: the request computes from here
    reused_gpu: int
    reused_host: int
    loading: Transfer | None = None  # its rows on their way back from host memory

    @property
    def ready(self) -> bool:
        """Its rows are all in its blocks: nothing it reads is still being copied there."""
        return self.loading is None or self.loading.finished


class PrefixCache:
    def __init__(self, kv: KVStore, host_budget_bytes: int, enabled: bool, by_hash: bool = True,
                 headroom_blocks: int = 0) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.block_tokens = kv.shape.block_tokens
        block_bytes = kv.shape.block_bytes(kv.dtype)
        self.arena = HostArena(kv, host_budget_bytes // block_bytes) if enabled and host_budget_bytes >= block_bytes \
            else None
        self._leaving: list[tuple[BlockTable, Transfer]] = []  # blocks held until their copy to host has run
        self.enabled = enabled
        # The Talker's cache matches by entry only: its rows of a user token depend on the Thinker's
        # whole prefix, which its keys do not hold (speech.py checks that per entry).
        self.by_hash = by_hash
        self.headroom_blocks = headroom_blocks  # kept free while idle (`make_room`)
        self.entries: dict[tuple[str, str], Entry] = {}  # by (principal, session)
        self._clock = itertools.count(1)

    # Accounting -----------------------------------------------------------------------------

    @property
    def gpu_bytes(self) -> int:
        """Device bytes of the blocks held: at most the store's allocation, which is the budget."""
        return self.pool.held * self.kv.shape.block_bytes(self.kv.dtype)

    @property
    def host_bytes(self) -> int:
        return sum(e.host.nbytes for e in self.entries.values() if e.host is not None)

    def entry(self, session: str, principal: str = LOCAL_USER) -> Entry | None:
        """`principal`'s `session`'s entry, if the cache holds one."""
        return self.entries.get((principal, session))

    # The request's life: match, claim, publish, release ---------------------------------------

    def match(self, prompt: Prompt, session: str | None = None, principal: str = LOCAL_USER) -> Match:
        """The longest verified prefix of `prompt` that `principal` holds (never its last token).
        Given the asking `session`, a prefix of another chat's shorter than a block is not taken: its
        rows would be copied to save less compute than the copy costs, and a prompt that begins its
        chat (most share the chat template's first tokens) would lose the prefill that attends over
        its own rows alone."""
        best = self._longest(prompt, principal)
        if session is None or best.length >= self.block_tokens or (best.entry is not None
                                                                   and best.entry.session == session):
            return best
        own = self.entry(session, principal)  # as long a match as another chat's, maybe
        length = _verified_prefix(own, prompt) if own is not None else 0
        return Match(own, length) if length else Match(None, 0)

    def _longest(self, prompt: Prompt, principal: str) -> Match:
        if not self.enabled:
            return Match(None, 0)
        best = Match(None, 0)
        for entry in self.entries.values():
            length = _verified_prefix(entry, prompt) if entry.principal == principal else 0
            if length > best.length or (length == best.length and length and entry.table is not None
                                        and not best.on_device):
                best = Match(entry, length)
        if self.by_hash:
            found = self.pool.lookup(chain(prompt.keys, _spans(prompt), self.block_tokens,
                                           (prompt.num_tokens - 1) // self.block_tokens, principal_salt(principal)))
            own = {m.start: m.digest for m in prompt.media}
            length = common_prefix(prompt.keys, own, prompt, len(found) * self.block_tokens)
            if length > best.length or (length == best.length and length and not best.on_device):
                best = Match(None, length, tuple(found[: self.kv.shape.blocks_for(length)]))
        return best

    def claim(self, session: str, prompt: Prompt, match: Match, rows: int, at_most: int | None = None,
              principal: str = LOCAL_USER) -> Claim | None:
        """Blocks for `principal`'s `session`'s request, `rows` rows for now (its prompt and the start
        of its reply), the matched prefix (`principal`'s) in them; None while running requests hold
        too many blocks (the request waits). The session's entry is pinned until `release`. A request
        that may write `at_most` rows (`rows` if not given), more than the pool's blocks hold, fails
        at once."""
        need, most = self.kv.shape.blocks_for(rows), at_most or rows
        if self.kv.shape.blocks_for(most) > self.pool.usable:
            raise RequestError(f"this request needs {most:,} tokens of KV, more than the {self.kv.capacity_tokens:,} "
                               "the device holds (gpu_cache_bytes): ask for a shorter reply or conversation")
        assert match.entry is None or match.entry.principal == principal, "a match of another principal's KV"
        own = self.entry(session, principal)
        if own is not None and own.pins:
            return None  # the session's previous request still runs
        claim = self._claim(principal, session, own, prompt, match, need)
        source = match.entry
        if claim is None and source is not None and source is not own and source.table is not None and not source.pins:
            # Only the match's own source can make room: let it move, then match again, now against
            # wherever its rows went (host memory, its blocks found by hash, or nowhere).
            self._move_to_host(source, keep=None)
            claim = self._claim(principal, session, self.entry(session, principal), prompt,
                                self.match(prompt, session, principal), need)
        return claim

    def _claim(self, principal: str, session: str, own: Entry | None, prompt: Prompt, match: Match, need: int
               ) -> Claim | None:
        shared, tail, continued = self._shared_blocks(match, own)
        self.pool.hold(shared)
        borrowed = [tail] if tail is not None and not continued else []  # held by _shared_blocks until copied
        fresh = need - len(shared)
        mine = own.table if own is not None and own.table is not None else []
        if not self._free_up(fresh, match.entry, own, freed_with_own=sum(self.pool.holders(b) == 1 for b in mine)):
            self.pool.release(shared + borrowed)
            return None
        source = match.entry
        host = source.host if match.length and not match.on_device else None  # kept while `own` is dropped
        if own is not None:
            self._drop(own)  # replaced by the state this request starts from; the blocks it shares are held
        table = shared + self.kv.take(fresh)
        reused_gpu = reused_host = 0
        loading = None
        if host is not None:
            # Queued after `own` was dropped (its arena slots freed, if the match was its own): no
            # copy into them is queued before this one out of them.
            loading = self._restore(host, table, match.length)
            reused_host = match.length
        elif match.length:
            if borrowed:
                self.kv.copy_block(tail, table[len(shared)], match.length % self.block_tokens)
            reused_gpu = match.length
        self.pool.release(borrowed)
        if source is not None:
            source.last_used = next(self._clock)
        keys = prompt.keys[: match.length].copy()
        media = {m.start: m.digest for m in prompt.media if m.end <= match.length}
        entry = Entry(principal, session, keys, media, table=table, pins=1, last_used=next(self._clock))
        self.entries[entry.owner] = entry
        return Claim(entry, match.length, reused_gpu, reused_host, loading)

    def _shared_blocks(self, match: Match, own: Entry | None) -> tuple[list[int], int | None, bool]:
        """The match's blocks the claim will hold: its full blocks, and its partly matched last block
        when only the session's own entry holds that one (continued in place, `continued`); `tail`,
        that last block, is held meanwhile either way (a copy is made of it)."""
        if not match.length or not match.on_device:
            return [], None, False
        table = list(match.blocks) if match.blocks else match.entry.table
        full, partial = divmod(match.length, self.block_tokens)
        shared, tail = table[:full], table[full] if partial else None
        continued = (tail is not None and match.entry is own and own is not None
                     and self.pool.holders(tail) == 1 and not self.pool.is_registered(tail))
        if continued:
            return [*shared, tail], tail, True
        if tail is not None:
            self.pool.hold([tail])  # until copied: nothing hands it out meanwhile
        return shared, tail, False

    def publish(self, claim: Claim, prompt: Prompt, reply: list[int], written: int) -> None:
        """The KV of the first `written` tokens of prompt-then-reply is in its blocks now: full blocks
        among them are registered by hash."""
        entry = claim.entry
        if written <= prompt.num_tokens:
            entry.keys = prompt.keys[:written].copy()
        else:
            entry.keys = np.concatenate([prompt.keys, np.asarray(reply[: written - prompt.num_tokens], np.int64)])
        entry.media = {m.start: m.digest for m in prompt.media if m.end <= written}
        full = written // self.block_tokens
        if self.by_hash and self.enabled and full > entry.registered and entry.table is not None:
            salt = principal_salt(entry.principal)
            for index, key in enumerate(chain(entry.keys, _spans(prompt), self.block_tokens, full, salt)):
                if index >= entry.registered:
                    self.pool.register(entry.table[index], key)
            entry.registered = full

    def release(self, claim: Claim) -> None:
        """The request is done with its blocks: those past what it wrote go back to the pool (a
        parked one's rows stay in host memory, the session's entry there)."""
        entry = claim.entry
        entry.pins -= 1
        assert entry.pins >= 0
        entry.last_used = next(self._clock)
        if entry.table is not None:
            keep = self.kv.shape.blocks_for(entry.length)
            self.pool.release(entry.table[keep:])
            entry.table = entry.table[:keep]
        if not self.enabled and entry.pins == 0:
            self._drop(entry)

    def grow(self, claim: Claim, rows: int) -> bool:
        """Blocks for the claim's first `rows` rows (a reply that outgrew its blocks), free ones or
        made free by moving idle entries to host memory; whether it has them (False: running
        requests hold the rest)."""
        entry = claim.entry
        more = self.kv.shape.blocks_for(rows) - len(entry.table)
        if more <= 0:
            return True
        if not self._free_up(more, keep=None, own=entry, freed_with_own=0):
            return False
        entry.table.extend(self.kv.take(more))  # in place: the engine's view of the table is this list
        return True

    def park(self, claim: Claim, rows: int) -> None:
        """Preempt the claim's request: its first `rows` rows to host memory, the arena's (idle
        entries dropped for room) or, where it has too few blocks, a copy of their own (a running
        request's rows are never dropped), and its blocks back to the pool. Its blocks registered
        by hash stay findable until handed out again."""
        entry = claim.entry
        assert entry.table is not None, "a parked request is parked once"
        saved = self._save(entry.table, rows, keep=None)
        if saved is None:
            entry.host = self.kv.to_host(entry.table, rows)
            self.pool.release(entry.table)
        else:
            entry.host = saved
        entry.table = None

    def resume(self, claim: Claim, rows: int) -> bool:
        """A parked claim's rows back on the device, in fresh blocks for `rows` rows (free ones, or
        made free by moving idle entries); whether it could have them (else it stays parked)."""
        entry = claim.entry
        need = self.kv.shape.blocks_for(rows)
        if not self._free_up(need, keep=None, own=entry, freed_with_own=0):
            return False
        table = self.kv.take(need)
        claim.loading = self._restore(entry.host, table, entry.host.rows)
        self._forget_host(entry)
        entry.table = table
        return True

    def settle(self) -> None:
        """Give the pool the blocks whose copy to host memory has run."""
        leaving, self._leaving = self._leaving, []
        for table, transfer in leaving:
            if transfer.finished:
                self.pool.release(table)
            else:
                self._leaving.append((table, transfer))

    def discard(self, claim: Claim) -> None:
        """Release `claim` and forget what its request wrote: its outputs were not numbers, so its
        rows must reach no attention again. The blocks it alone holds, from the one its computed rows
        begin in, are zeroed and unregistered, and the session's entry is dropped (its next turn
        starts afresh). A block another chat holds is kept: others share only published rows, and a
        request publishes its prompt's rows once its first token's logits are checked (the failure
        came later, in its reply) and its reply's only when it ends."""
        entry = claim.entry
        entry.pins -= 1
        assert entry.pins == 0, "a session's entry is held by one request at a time"
        written = [b for b in entry.table[claim.start // self.block_tokens :] if self.pool.holders(b) == 1]
        # The pad block too: a graphed prefill's padding past the request's blocks was written there.
        self.kv.scrub([PAD_BLOCK, *written])
        self._drop(entry)

    # Memory ---------------------------------------------------------------------------------

    def make_room(self) -> None:
        """Keep `headroom_blocks` free while nobody waits, so moving an entry to host memory (a copy
        of all its KV) is not paid inside the next request's time to first token. The moves are only
        queued: their blocks come free once they have run."""
        self._free_up(self.headroom_blocks, keep=None, own=None, freed_with_own=0, wait=False)

    def _free_up(self, count: int, keep: Entry | None, own: Entry | None, freed_with_own: int,
                 wait: bool = True) -> bool:
        """Move idle entries (not `keep`, not `own`, whose blocks free `freed_with_own` more once
        dropped) to host memory until `count` blocks can be had; whether they can. Where they are
        the blocks of moves still queued, the host waits for those (with `wait`; else False)."""
        while True:
            self.settle()
            if self.pool.free + freed_with_own >= count:
                return True
            coming = sum(self.pool.holders(b) == 1 for table, _ in self._leaving for b in table)
            enough_coming = self.pool.free + coming + freed_with_own >= count
            victim = None if enough_coming else self._least_recent_on_device(keep, own)
            if victim is not None:
                self._move_to_host(victim, keep)
            elif self._leaving and wait:
                self._leaving[0][1].wait()
            else:
                return False

    def _least_recent_on_device(self, keep: Entry | None, own: Entry | None) -> Entry | None:
        candidates = [e for e in self.entries.values()
                      if e.table is not None and e.pins == 0 and e is not keep and e is not own]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def _move_to_host(self, entry: Entry, keep: Entry | None) -> None:
        saved = self._save(entry.table, entry.length, keep) if entry.length else None
        if saved is None:
            self._drop(entry)
        else:
            entry.host, entry.table = saved, None

    def _save(self, table: BlockTable, rows: int, keep: Entry | None) -> HostBlocks | None:
        """Queue the copy of the sequence's first `rows` rows to the arena (its oldest idle entries,
        not `keep`, dropped for room), its blocks held until it has run; None where it cannot."""
        if self.arena is None or self.kv.shape.blocks_for(rows) > self.arena.blocks:
            return None
        while self.arena.free < self.kv.shape.blocks_for(rows) and self._drop_oldest_on_host(keep):
            pass
        saved = self.arena.save(table, rows)
        if saved is not None:
            self._leaving.append((table, saved.saved))
        return saved

    def _restore(self, host: HostBlocks | HostCopy, table: BlockTable, rows: int) -> Transfer | None:
        """Queue the copy of `host`'s first `rows` rows into `table`'s blocks (a parked request's
        own copy is copied at once)."""
        if isinstance(host, HostBlocks):
            return self.arena.load(host, table, rows)
        self.kv.from_host(host, table, rows)
        return None

    def _forget_host(self, entry: Entry) -> None:
        if isinstance(entry.host, HostBlocks):
            self.arena.release(entry.host)
        entry.host = None

    def _drop_oldest_on_host(self, keep: Entry | None) -> bool:
        on_host = (e for e in self.entries.values() if e.host is not None and e is not keep and not e.pins)
        oldest = min(on_host, key=lambda e: e.last_used, default=None)
        if oldest is None:
            return False
        self._drop(oldest)
        return True

    def _drop(self, entry: Entry) -> None:
        if entry.table is not None:
            self.pool.release(entry.table)
        self._forget_host(entry)
        entry.table = None
        if self.entries.get(entry.owner) is entry:
            del self.entries[entry.owner]


def _spans(prompt: Prompt) -> list[tuple[int, int, bytes]]:
    """(start, end, full digest) of the prompt's media: a block's hash holds those its tokens are of."""
    return [(m.start, m.end, m.digest) for m in prompt.media]


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
