"""The host tier of the KV: blocks of host memory allocated once at start-up (pinned, on CUDA), and
the copies between them and a KVStore's blocks, queued on a copy stream of their own. Page-locking
takes seconds (2.9 s for 8 GiB while the full model started on an H200, py-spy), so it runs on a
thread of its own: start-up does not wait for it, and the first copy waits for it to end.

Neither the host nor the compute stream waits for a copy:
- to host (`save`): the copy stream first waits for the work queued on the compute stream (the
  rows' last writes), then gathers each layer's blocks into a small device buffer and copies it to
  the arena. The device blocks may be handed out again once the copy is `finished` (the caller keeps
  them held until then: the compute stream could overwrite them before the gather read them).
- back (`load`): the copy stream waits for the compute stream (the fresh blocks were zeroed there),
  copies the arena's rows to a device buffer and scatters them into the blocks. Nothing may read
  those blocks before the copy is `finished` (the engine runs the request's prefill only then).
Every arena read and write is on the one copy stream, in the order queued, so a slot freed may be
written again at once: a later copy into it comes after the earlier ones out of it. Each layer's
device buffer is allocated on the copy stream, so the caching allocator hands its memory to that
stream alone until the copy that reads it has run.

On the CPU, or where the memory could not be page-locked, there is no copy stream: each copy runs
on the current stream and is done (for the host) when the call returns.
"""

import itertools
import logging
import math
import threading
import weakref
from dataclasses import dataclass

import torch

from omni_local.engine.memory.host_copies import to_device
from omni_local.engine.memory.kv_store import BlockTable, KVStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """A copy queued on the copy stream; `done` is passed once it has run (None: it ran already)."""

    done: torch.cuda.Event | None = None

    @property
    def finished(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        """Make the host wait for it (only where a request cannot go on without its blocks)."""
        if self.done is not None:
            self.done.synchronize()


@dataclass(frozen=True)
class HostBlocks:
    """A sequence's first `rows` rows in arena `slots`, there once `saved` is finished."""

    slots: list[int]
    rows: int
    block_bytes: int
    saved: Transfer

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.block_bytes


class HostArena:
    def __init__(self, store: KVStore, blocks: int) -> None:
        self.store, self.blocks = store, blocks
        shapes = [(t.dtype, (blocks, *t.shape[1:])) for t in store.block_tensors()]
        sizes = [dtype.itemsize * math.prod(shape) for dtype, shape in shapes]
        # One allocation, pinned as it is: torch's pinned allocator would round each tensor up to a
        # power of two of bytes, and keep it.
        self._memory = torch.empty(sum(sizes), dtype=torch.uint8)
        self._stream: torch.cuda.Stream | None = None  # set by `_pin`, where the memory could be pinned
        self._pinning = threading.Thread(target=self._pin, name="omni-pin-kv", daemon=True)
        if store.device.type == "cuda":
            self._pinning.start()
        # One arena tensor per device block tensor, of `blocks` blocks of its layout.
        offsets = itertools.accumulate(sizes, initial=0)
        self._tensors = [self._memory[at : at + size].view(dtype).view(shape)
                         for (dtype, shape), size, at in zip(shapes, sizes, offsets)]
        self._free = list(range(blocks))  # kept sorted: a save takes the lowest, so its slots run on

    @property
    def free(self) -> int:
        return len(self._free)

    def save(self, table: BlockTable, rows: int) -> HostBlocks | None:
        """Queue the copy of the first `rows` rows of the blocks of `table` to the arena; None if too
        few of its slots are free."""
        count = self.store.shape.blocks_for(rows)
        if count > len(self._free):
            return None
        slots, self._free = self._free[:count], self._free[count:]
        done = self._queue(lambda: self._copy_out(table[:count], slots))
        return HostBlocks(slots, rows, self.store.shape.block_bytes(self.store.dtype), done)

    def load(self, host: HostBlocks, table: BlockTable, rows: int) -> Transfer:
        """Queue the copy of `host`'s first `rows` rows into the first blocks of `table`, whole
        blocks (fresh ones: the rows after `rows` in the last are the arena's too, past the
        sequence's end, which its own rows overwrite)."""
        count = self.store.shape.blocks_for(rows)
        return self._queue(lambda: self._copy_in(host.slots[:count], table[:count]))

    def release(self, host: HostBlocks) -> None:
        """`host`'s slots may be written again (by copies queued from now on)."""
        self._free = sorted(self._free + host.slots)

    def _pin(self) -> None:
        with torch.cuda.device(self.store.device):  # a new thread's current device is cuda:0
            if _pinned(self._memory):
                weakref.finalize(self, _unpin, self._memory)
                self._stream = torch.cuda.Stream(self.store.device)

    def _queue(self, copies) -> Transfer:
        if self._pinning.is_alive():
            self._pinning.join()
        if self._stream is None:
            copies()
            return Transfer()
        self._stream.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self._stream):
            copies()
            done = torch.cuda.Event()
            done.record()
        return Transfer(done)

    def _copy_out(self, blocks: BlockTable, slots: list[int]) -> None:
        index = to_device(torch.tensor(blocks, dtype=torch.long), self.store.device)
        for device_tensor, arena in zip(self.store.block_tensors(), self._tensors):
            gathered = device_tensor.index_select(0, index)
            for first, last, at in _runs(slots):
                arena[first:last].copy_(gathered[at : at + last - first], non_blocking=True)

    def _copy_in(self, slots: list[int], blocks: BlockTable) -> None:
        index = to_device(torch.tensor(blocks, dtype=torch.long), self.store.device)
        for device_tensor, arena in zip(self.store.block_tensors(), self._tensors):
            rows = torch.empty((len(slots), *arena.shape[1:]), dtype=arena.dtype, device=self.store.device)
            for first, last, at in _runs(slots):
                rows[at : at + last - first].copy_(arena[first:last], non_blocking=True)
            device_tensor.index_copy_(0, index, rows)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, slot after the last, position in `slots`) of each run of consecutive slots."""
    runs, begin = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((slots[begin], slots[i - 1] + 1, begin))
            begin = i
    return runs


def _pinned(memory: torch.Tensor) -> bool:
    """Page-lock `memory` for asynchronous copies (cudaHostRegister, as torch's own helpers do);
    whether it could be. Where not, the copies still run, each waited for."""
    error = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.nbytes, 0))
    if error:
        log.warning("could not page-lock %s bytes of host memory for the KV (cudaError %d): its moves to and from "
                    "the GPU will wait for their copies; lower host_cache_bytes", f"{memory.nbytes:,}", error)
    return not error


def _unpin(memory: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
