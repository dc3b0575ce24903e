"""The Thinker's KV, owned by the engine and allocated once at start-up.

Layout, per decoder layer: keys and values of shape [slots, kv_heads, max_tokens, head_dim].
A chat session's sequence lives in one slot; token t of it in row t of that slot in every layer.
Fixed addresses are what a CUDA graph needs, a slot is what a session's next turn continues in
place, and several slots decoding together are one batch. Rows move between slots, and out to
host memory and back, for the prefix cache.

With speech, each token also has a Talker row ([slots, max_tokens, talker_hidden]): what the
Talker reads for it when it is a user token. Kept beside the KV and moved with it, so a spoken reply
to a cached prompt finds every user token's row without recomputing the Thinker.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int  # rows per slot
    talker_dim: int = 0  # width of each token's Talker row; 0: none kept

    def token_bytes(self, dtype: torch.dtype) -> int:
        return (2 * self.num_layers * self.kv_heads * self.head_dim + self.talker_dim) * dtype.itemsize

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return self.token_bytes(dtype) * self.max_tokens


@dataclass(frozen=True)
class HostCopy:
    """A slot's first rows in host memory."""

    kv: torch.Tensor  # [layers, 2, kv_heads, rows, head_dim]
    talker_rows: torch.Tensor | None  # [rows, talker_dim]

    @property
    def nbytes(self) -> int:
        rows = self.talker_rows
        return self.kv.nbytes + (rows.nbytes if rows is not None else 0)


class KVStore:
    def __init__(
        self, shape: KVShape, slots: int, dtype: torch.dtype, device: torch.device, zeroed: bool = False
    ) -> None:
        self.shape, self.slots, self.dtype, self.device = shape, slots, dtype, device
        size = (slots, shape.kv_heads, shape.max_tokens, shape.head_dim)
        # Eager attention reads rows [0, end) of its own slot only, so rows are never read before
        # written and are left uninitialised (on the CPU, untouched pages cost no memory). Graphed
        # decode steps and prefills read a whole bucket of rows and mask those past each new token,
        # but a zero attention weight does not cancel a NaN or an infinity (0 × NaN is NaN): one
        # chat's bad rows, past the end of the next chat in its slot, would poison that chat's every
        # output. So with `zeroed` every free slot holds zeros (from here, and again whenever a slot is
        # given back), and a slot's rows past its holder's end are zeros or its own session's.
        self.zeroed = zeroed
        make = torch.zeros if zeroed else torch.empty
        self.keys = [make(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [make(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.talker_rows = (
            torch.empty((slots, shape.max_tokens, shape.talker_dim), dtype=dtype, device=device)
            if shape.talker_dim else None
        )
        self._free = list(range(slots - 1, -1, -1))

    @property
    def allocated_bytes(self) -> int:
        return sum(t.nbytes for t in self._slot_tensors())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int, scrub: bool = False) -> None:
        """Give `slot` back; its rows are zeroed first if the store keeps free slots zeroed, or if
        `scrub` (its holder's rows are not numbers and must never be read again)."""
        assert 0 <= slot < self.slots and slot not in self._free, f"slot {slot} is not held"
        if self.zeroed or scrub:
            # Once per hand-over, queued after every forward that wrote the slot, never inside a decode
            # step: 768 MiB for a full-size Thinker slot of 8,192 rows, well under a millisecond of an
            # H200's memory bandwidth.
            for tensor in self._slot_tensors():
                tensor[slot].zero_()
        self._free.append(slot)

    def forget_rows(self, slot: int, start: int) -> None:
        """The KV rows of `slot` from `start` on hold nothing anyone vouches for (a prefill cut short
        wrote them): zeroed if the store keeps rows past a chat's end for graphs to read."""
        if self.zeroed:
            for layer in self.keys + self.values:
                layer[slot, :, start:].zero_()

    def view(self, slot: int, start: int) -> "KVWriter":
        return KVWriter(self, slot, start)

    def copy_rows(self, source: int, target: int, rows: int) -> None:
        for layer in self.keys + self.values:
            layer[target, :, :rows].copy_(layer[source, :, :rows])
        if self.talker_rows is not None:
            self.talker_rows[target, :rows].copy_(self.talker_rows[source, :rows])

    def to_host(self, slot: int, rows: int) -> HostCopy:
        """A copy of the slot's first `rows` rows in host memory, never a view of the slot (on the
        CPU `.to("cpu")` alone would be one), whose rows the slot's next chat overwrites.

        The KV is gathered on the device first, then moved in one transfer, instead of one copy per layer
        into a fresh pinned buffer (requests that moved an entry that way ran about 60 ms slower on
        an H200; the move itself was not timed apart). The copy is waited for: an asynchronous one
        needs pinned memory, which torch's caching allocator rounds up to a power of two and keeps
        pinned, so host memory could reach twice `host_cache_bytes`."""
        gathered = torch.stack([torch.stack([k[slot, :, :rows], v[slot, :, :rows]]) for k, v in self._pairs()])
        talker_rows = self.talker_rows[slot, :rows].to("cpu", copy=True) if self.talker_rows is not None else None
        return HostCopy(gathered.to("cpu"), talker_rows)

    def from_host(self, host: HostCopy, slot: int, rows: int) -> None:
        on_device = host.kv[:, :, :, :rows].to(self.device)
        for i, (k, v) in enumerate(self._pairs()):
            k[slot, :, :rows].copy_(on_device[i, 0])
            v[slot, :, :rows].copy_(on_device[i, 1])
        if self.talker_rows is not None:
            self.talker_rows[slot, :rows].copy_(host.talker_rows[:rows])

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values))

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a slot as its first dimension."""
        return self.keys + self.values + ([self.talker_rows] if self.talker_rows is not None else [])


class KVWriter:
    """What transformers' attention modules receive as `cache` for one forward of one slot.

    The modules call `update(k, v, layer_idx)` with the new tokens' keys and values
    ([1, kv_heads, n, head_dim]); we write them at rows [start, start + n) of the slot and hand
    back every row the new tokens may attend to.
    """

    def __init__(self, store: KVStore, slot: int, start: int) -> None:
        self.store, self.slot, self.start = store, slot, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.start + key_states.shape[2]
        if end > self.store.shape.max_tokens:
            raise IndexError(f"slot holds {self.store.shape.max_tokens} tokens, asked to write up to {end}")
        keys = self.store.keys[layer_idx][self.slot : self.slot + 1]
        values = self.store.values[layer_idx][self.slot : self.slot + 1]
        keys[:, :, self.start : end] = key_states
        values[:, :, self.start : end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def attention_mask(self, implementation: str, length: int, like: torch.Tensor) -> torch.Tensor | None:
        """The mask for the `length` new tokens over the rows `update` hands back."""
        return causal_mask(implementation, self.start, length, like)

    def last_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, 1, hidden] of [1, n, hidden]: the last new token's, whose output is wanted."""
        return hidden[:, -1:]


class GraphedKVWriter:
    """The `cache` of a forward captured in a CUDA graph: B sequences of L new tokens, each sequence
    in its own slot (B > 1: several chats decoding together; L > 1: a short prefill).

    `slots` [B], `indices` [B, L] (the row each new token is written to) and `last` [B] (which new
    token's output is wanted) are device tensors read when the graph replays, so one graph serves
    every slot and position. `update` hands back each slot's first `rows` rows (the graph's bucket),
    not the filled length, whose size a graph cannot change; the mask hides the rows after each new
    token, which is enough only because those rows hold numbers: zeros, or the session's own (a
    store for graphs keeps its free slots zeroed).
    """

    def __init__(self, store: KVStore, slots: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
                 rows: int) -> None:
        self.store, self.slots, self.indices, self.last, self.rows = store, slots, indices, last, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.store.keys[layer_idx], self.store.values[layer_idx]
        # keys[slots[:, None], :, indices] is [B, L, kv_heads, head_dim]: each new token's row, an index_put_
        where = (self.slots[:, None], slice(None), self.indices)
        keys[where] = key_states.transpose(1, 2)
        values[where] = value_states.transpose(1, 2)
        # [B, kv_heads, rows, head_dim]: a copy of the bucket's rows; the slots are not known at capture
        return (keys[:, :, : self.rows].index_select(0, self.slots),
                values[:, :, : self.rows].index_select(0, self.slots))

    def attention_mask(self, implementation: str, length: int, like: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(self.rows, device=like.device)
        allowed = rows[None, None, None, :] <= self.indices[:, None, :, None]  # [B, 1, L, rows]
        return _kernel_mask(allowed, implementation, like)

    def last_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, 1, hidden] of [B, L, hidden]: each sequence's wanted token (the rest is padding)."""
        return hidden.gather(1, self.last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))


def causal_mask(implementation: str, start: int, length: int, like: torch.Tensor) -> torch.Tensor | None:
    """The mask for `length` new tokens after `start` cached ones, in the form each kernel wants.

    SDPA and flash attention apply the causal rule themselves where it is right (an empty prefix,
    or one new token; flash aligns it bottom-right, so a tail on a prefix too). Passing None there,
    as transformers does, keeps our logits bit-identical to its own.
    """
    if length == 1 or implementation == "flash_attention_2" or (start == 0 and implementation == "sdpa"):
        return None
    rows = torch.arange(length, device=like.device)[:, None] + start
    cols = torch.arange(start + length, device=like.device)[None, :]
    return _kernel_mask((cols <= rows)[None, None], implementation, like)


def _kernel_mask(allowed: torch.Tensor, implementation: str, like: torch.Tensor) -> torch.Tensor:
    """SDPA takes the boolean mask; eager attention adds the mask to the scores."""
    if implementation == "sdpa":
        return allowed
    blocked = torch.finfo(like.dtype).min
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, blocked)
