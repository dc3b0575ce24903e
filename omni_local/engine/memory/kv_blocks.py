"""The books of the KV's blocks: which are free, who holds each, and which hold a known prefix.

Every sequence's KV lives in blocks of `block_tokens` rows drawn from one pool (KVStore holds the
tensors; this file only keeps the books). A sequence is its block table: its blocks in order, token
t in row t % block_tokens of block t // block_tokens. A block is held, once per holder, by every
cache entry and running request whose table lists it, and is free when nobody holds it. Chats that
begin with the same system prompt list the same blocks for it: it is held once, however many hold it.

A full block whose rows are published (computed, their logits checked) is registered under a chained
hash: BLAKE3 over its parent's hash, its tokens' keys and the full digests of the media among them.
A sequence's first block's parent is its principal's salt (as vLLM's `cache_salt`), so one principal
never finds another's blocks. A prompt finds every full block of its prefix by hash, whichever of its
principal's chats computed it, and even once nobody
holds it: a free block keeps its rows and its registration until it is handed out again, blocks
never registered first, then the least recently freed. A hit is checked against the block's whole
key (its parent's hash, its tokens' keys, the digests), so not even a hash collision passes as one.

Block 0 is held by nobody and handed to nobody: the rows a graphed prefill pads with, past a
sequence's own blocks, are written there and read only masked.
"""

from collections import OrderedDict
from dataclasses import dataclass

import blake3
import numpy as np

PAD_BLOCK = 0
ROOT = b""  # the parent hash of a sequence's first block, where no principal's salt is given


@dataclass(frozen=True)
class BlockKey:
    """What a full block holds, as a prefix of a sequence: its rows' tokens after its parent's."""

    parent: bytes  # the previous block's hash; the sequence's salt for the first
    keys: bytes  # its tokens' keys (int64, as Prompt.keys holds them)
    digests: bytes  # the full digests of the media its tokens belong to, in order

    @property
    def hash(self) -> bytes:
        return blake3.blake3(b"%d\0" % len(self.parent) + self.parent + self.keys + self.digests).digest()


def chain(keys: np.ndarray, media: list[tuple[int, int, bytes]], block_tokens: int, blocks: int,
          salt: bytes = ROOT) -> list[BlockKey]:
    """The BlockKeys of the first `blocks` full blocks of a sequence of token `keys` whose media are
    (start, end, digest), its first block's parent `salt` (its principal's)."""
    out, parent = [], salt
    for index in range(blocks):
        start, end = index * block_tokens, (index + 1) * block_tokens
        digests = b"".join(digest for first, last, digest in media if first < end and last > start)
        key = BlockKey(parent, keys[start:end].astype(np.int64).tobytes(), digests)
        out.append(key)
        parent = key.hash
    return out


class BlockPool:
    def __init__(self, blocks: int, block_tokens: int) -> None:
        assert blocks >= 2, "the pad block and one to hold"
        self.blocks, self.block_tokens = blocks, block_tokens
        self._holders = [0] * blocks
        self._plain = list(range(blocks - 1, PAD_BLOCK, -1))  # free, never registered: handed out first, lowest first
        self._registered_free: OrderedDict[int, None] = OrderedDict()  # free and registered, least recently freed first
        self._by_hash: dict[bytes, int] = {}
        self._key_of: dict[int, BlockKey] = {}

    # Accounting -----------------------------------------------------------------------------

    @property
    def usable(self) -> int:
        """Blocks a sequence can hold: all but the pad block."""
        return self.blocks - 1

    @property
    def free(self) -> int:
        return len(self._plain) + len(self._registered_free)

    @property
    def held(self) -> int:
        return self.usable - self.free

    def holders(self, block: int) -> int:
        return self._holders[block]

    def is_registered(self, block: int) -> bool:
        return block in self._key_of

    # Holding --------------------------------------------------------------------------------

    def take(self, count: int) -> list[int] | None:
        """`count` free blocks, held once each; None if fewer are free (nothing is taken then). A
        registered block handed out loses its registration: its rows are about to change."""
        if count > self.free:
            return None
        taken = []
        for _ in range(count):
            if self._plain:
                block = self._plain.pop()
            else:
                block, _ = self._registered_free.popitem(last=False)
                del self._by_hash[self._key_of.pop(block).hash]
            self._holders[block] = 1
            taken.append(block)
        return taken

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (registered or held already; a free registered block
        found by hash is held again)."""
        for block in blocks:
            assert block != PAD_BLOCK
            if self._holders[block] == 0:
                assert block in self._registered_free, f"block {block} is free and unregistered: its rows are nobody's"
                del self._registered_free[block]
            self._holders[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder less for each of `blocks`; a block nobody holds is free (and, registered, still
        found by hash until handed out again). The last blocks of a table are freed first, so a
        sequence's later blocks are handed out before its earlier ones, whose prefix is more shared."""
        for block in reversed(blocks):
            assert self._holders[block] > 0, f"block {block} is not held"
            self._holders[block] -= 1
            if self._holders[block] == 0:
                if block in self._key_of:
                    self._registered_free[block] = None
                else:
                    self._plain.append(block)

    # Registration ---------------------------------------------------------------------------

    def register(self, block: int, key: BlockKey) -> None:
        """`block`, held, is full and published with `key`. A key registered already keeps its block:
        the same prefix computed twice (two chats at once) is found as the first one."""
        assert self._holders[block] > 0
        if block in self._key_of or key.hash in self._by_hash:
            return
        self._by_hash[key.hash] = block
        self._key_of[block] = key

    def unregister(self, blocks: list[int]) -> None:
        """Forget `blocks`' registrations: their rows are not to be found again (scrubbed)."""
        for block in blocks:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._by_hash[key.hash]
                if block in self._registered_free:
                    del self._registered_free[block]
                    self._plain.append(block)

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The registered blocks of the longest prefix of `keys` (a chain), each checked by its whole key."""
        found = []
        for key in keys:
            block = self._by_hash.get(key.hash)
            if block is None or self._key_of[block] != key:
                break
            found.append(block)
        return found
