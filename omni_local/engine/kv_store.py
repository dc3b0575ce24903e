"""The Thinker's KV, owned by the engine and allocated once at start-up.

Layout, per decoder layer: keys and values of shape [slots, kv_heads, max_tokens, head_dim].
A request (later: a chat session) holds one slot; token t of its sequence lives in row t of that
slot in every layer. Fixed addresses are what a CUDA graph needs, a slot is what a session's next
turn continues, and several slots decoding together are one batch.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    slots: int
    max_tokens: int

    def bytes(self, dtype: torch.dtype) -> int:
        per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * dtype.itemsize
        return per_token * self.slots * self.max_tokens


class KVStore:
    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        size = (shape.slots, shape.kv_heads, shape.max_tokens, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self._free = list(range(shape.slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.shape.slots and slot not in self._free, f"slot {slot} is not held"
        self._free.append(slot)

    def view(self, slot: int, start: int) -> "SlotWriter":
        return SlotWriter(self, slot, start)


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
