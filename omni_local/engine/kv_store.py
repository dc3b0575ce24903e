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
    def __init__(self, shape: KVShape, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.slots, self.dtype, self.device = shape, slots, dtype, device
        size = (slots, shape.kv_heads, shape.max_tokens, shape.head_dim)
        # Never read before written (attention reads rows [0, end) only), so left uninitialised.
        self.keys = [torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [torch.empty(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.talker_rows = (
            torch.empty((slots, shape.max_tokens, shape.talker_dim), dtype=dtype, device=device)
            if shape.talker_dim else None
        )
        self._free = list(range(slots - 1, -1, -1))

    @property
    def allocated_bytes(self) -> int:
        tensors = self.keys + self.values + ([self.talker_rows] if self.talker_rows is not None else [])
        return sum(t.nbytes for t in tensors)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.slots and slot not in self._free, f"slot {slot} is not held"
        self._free.append(slot)

    def view(self, slot: int, start: int) -> "SlotWriter":
        return SlotWriter(self, slot, start)

    def copy_rows(self, source: int, target: int, rows: int) -> None:
        for layer in self.keys + self.values:
            layer[target, :, :rows].copy_(layer[source, :, :rows])
        if self.talker_rows is not None:
            self.talker_rows[target, :rows].copy_(self.talker_rows[source, :rows])

    def to_host(self, slot: int, rows: int) -> HostCopy:
        """The slot's first `rows` rows, in host memory.

        The KV is gathered on the device first, then moved in one transfer, instead of one copy per layer
        into a fresh pinned buffer (requests that moved an entry that way ran about 60 ms slower on
        an H200; the move itself was not timed apart)."""
        gathered = torch.stack([torch.stack([k[slot, :, :rows], v[slot, :, :rows]]) for k, v in self._pairs()])
        talker_rows = self.talker_rows[slot, :rows].to("cpu") if self.talker_rows is not None else None
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


class SlotWriter:
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
