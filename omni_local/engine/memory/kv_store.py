"""The KV of the Thinker (and of the Talker), owned by the engine and allocated once at start-up.

Layout, per decoder layer: keys and values of shape [blocks, kv_heads, block_tokens, head_dim], one
pool of blocks for every sequence. A sequence is its block table (kv_blocks.py keeps the books):
token t in row t % block_tokens of block t // block_tokens, in every layer. Fixed addresses are what
a CUDA graph needs; a table is what a session's next turn continues, and what another session that
begins the same way shares, block by block, instead of copying. Only a partly filled block is ever
copied (its next writer would change what the other reads), and sequences move to host memory and
back for the prefix cache.

With speech, each token also has a Talker row ([blocks, block_tokens, talker_dim]): what the Talker
reads for it when it is a user token. Kept in the token's block and shared and moved with it, so a
spoken reply to a cached prompt finds every user token's row without recomputing the Thinker.

With `KVShape.fp8` (the `kv_dtype = "fp8"` setting, kv_fp8.py) keys and values are float8 with a
float32 scale per (token, kv head) beside them ([blocks, kv_heads, block_tokens], the same block
structure): every copy, move and zeroing of a block takes its scales with it, every writer
quantizes and every reader dequantizes.
"""

from dataclasses import dataclass

import torch

from omni_local.engine.memory.attention import PagedAttention
from omni_local.engine.memory.attention.reference import gathered, gathered_rows
from omni_local.engine.memory.host_copies import to_device
from omni_local.engine.memory.kv_blocks import BlockPool
from omni_local.engine.memory.kv_fp8 import SCALE_BYTES, as_pools, empty_pools, read_rows
from omni_local.kernels.attention import QueryNormRope

DEFAULT_BLOCK_TOKENS = 16

BlockTable = list[int]  # a sequence's blocks, in order


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int  # rows a sequence may have
    talker_dim: int = 0  # width of each token's Talker row; 0: none kept
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    fp8: bool = False  # keys and values in float8 with a scale per (token, kv head) (kv_fp8.py)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """A token's bytes in a model of `dtype`: its keys and values (fp8 ones with their scales), and
        its Talker row."""
        head_bytes = self.head_dim + SCALE_BYTES if self.fp8 else self.head_dim * dtype.itemsize
        return 2 * self.num_layers * self.kv_heads * head_bytes + self.talker_dim * dtype.itemsize

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.token_bytes(dtype) * self.block_tokens

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_tokens)

    @property
    def table_blocks(self) -> int:
        """The blocks of the longest sequence: the width of a graph's block tables."""
        return self.blocks_for(self.max_tokens)


@dataclass(frozen=True)
class HostCopy:
    """A sequence's first rows in host memory."""

    kv: torch.Tensor  # [layers, 2, kv_heads, rows, head_dim]
    talker_rows: torch.Tensor | None  # [rows, talker_dim]
    scales: torch.Tensor | None = None  # fp8 KV's: [layers, 2, kv_heads, rows, 1]

    @property
    def rows(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.kv, self.talker_rows, self.scales) if t is not None)


class KVStore:
    def __init__(
        self, shape: KVShape, blocks: int, dtype: torch.dtype, device: torch.device, zeroed: bool = False
    ) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.pool = BlockPool(blocks, shape.block_tokens)
        size = (blocks, shape.kv_heads, shape.block_tokens, shape.head_dim)
        # Eager attention and the kernel read a sequence's own rows only, so rows are never read
        # before written and are left uninitialised (on the CPU, untouched pages cost no memory).
        # Graphed forwards under transformers' attention read a whole bucket of rows and mask those
        # past each new token, but a zero attention weight does not cancel a NaN or an infinity
        # (0 x NaN is NaN): one chat's bad rows, past the end of the next chat in its blocks, would
        # poison that chat's every output. So with `zeroed` every block handed out holds zeros, and
        # a sequence's rows past its end are zeros or its own session's.
        self.zeroed = zeroed
        # Never inference tensors, whoever makes the store: a compiled layer guards on its pools'
        # dispatch keys, so a store made under inference mode would compile every region again (and,
        # past dynamo's recompile limit, fail) in a process that also holds the engine's stores.
        with torch.inference_mode(False):
            self._make_pools(blocks, size, zeroed)

    def _make_pools(self, blocks: int, size: tuple[int, ...], zeroed: bool) -> None:
        # Keys and values of every layer in one tensor, each layer's a view of it: zeroing or copying
        # a block is one launch, not one per layer and kind (96 at full size, about 2 ms of host time
        # on each request that takes blocks). fp8 ones' scales likewise, in a tensor of their own.
        shape, dtype, device = self.shape, self.dtype, self.device
        self._layers, self._scales = empty_pools((2, shape.num_layers, *size), shape.fp8, dtype, device, zeroed)
        # (Written in place under inference mode, as the engine's forwards run: with grad on, a write
        # of a value that requires grad into one view of a leaf is refused.)
        pools = as_pools(self._layers)
        self.keys, self.values = list(pools[0].unbind()), list(pools[1].unbind())
        # Each layer's (key scales, value scales) [blocks, kv_heads, block_tokens]; None: not fp8.
        self.scales = (list(zip(self._scales[0].unbind(), self._scales[1].unbind()))
                       if self._scales is not None else None)
        make = torch.zeros if zeroed else torch.empty
        self.talker_rows = (
            make((blocks, shape.block_tokens, shape.talker_dim), dtype=dtype, device=device)
            if shape.talker_dim else None
        )

    @classmethod
    def for_budget(cls, shape: KVShape, budget_bytes: int, dtype: torch.dtype, device: torch.device,
                   zeroed: bool = False) -> "KVStore":
        """As many blocks as `budget_bytes` holds, the pad block among them."""
        return cls(shape, budget_bytes // shape.block_bytes(dtype), dtype, device, zeroed)

    @property
    def allocated_bytes(self) -> int:
        return sum(t.nbytes for t in self.block_tensors())

    @property
    def token_bytes(self) -> int:
        return self.shape.token_bytes(self.dtype)

    @property
    def capacity_tokens(self) -> int:
        """Rows the pool holds for sequences."""
        return self.pool.usable * self.shape.block_tokens

    def take(self, count: int) -> BlockTable | None:
        """`count` free blocks, held; None if fewer are free. Zeroed first in a store that keeps
        them so: a block handed out again holds another sequence's rows."""
        blocks = self.pool.take(count)
        if blocks and self.zeroed:
            self._zero(blocks)
        return blocks

    def scrub(self, blocks: BlockTable) -> None:
        """Zero `blocks`: their rows are not numbers and must never be read again."""
        self.pool.unregister(blocks)
        self._zero(blocks)

    def forget_rows(self, table: BlockTable, start: int) -> None:
        """Rows from `start` on hold nothing anyone vouches for (a prefill cut short wrote them):
        zeroed if the store keeps rows past a sequence's end for graphs to read."""
        if not self.zeroed:
            return
        first = start // self.shape.block_tokens
        if first < len(table):
            offset = start - first * self.shape.block_tokens
            for rows in self._per_row():
                rows[:, :, table[first], :, offset:].zero_()
            self._zero(table[first + 1 :])

    def writer(self, table: BlockTable | torch.Tensor, start: int, kernel: PagedAttention | None = None
               ) -> "KVWriter":
        return KVWriter(self, table, start, kernel)

    def copy_block(self, source: int, target: int, rows: int) -> None:
        """The first `rows` rows of block `source` into block `target`: a partly shared block copied
        before it is written."""
        for per_row in self._per_row():
            per_row[:, :, target, :, :rows].copy_(per_row[:, :, source, :, :rows])
        if self.talker_rows is not None:
            self.talker_rows[target, :rows].copy_(self.talker_rows[source, :rows])

    def write_talker_rows(self, table: BlockTable, start: int, rows: torch.Tensor) -> None:
        """Talker rows [n, talker_dim] of the sequence's tokens from `start` on."""
        _, blocks, offsets = self.addresses(self.device_table(table), start, start + rows.shape[0])
        self.talker_rows[blocks, offsets] = rows

    def read_talker_rows(self, table: BlockTable, positions: torch.Tensor) -> torch.Tensor:
        """The Talker rows [n, talker_dim] of the sequence's tokens at `positions` (a device tensor)."""
        blocks = self.device_table(table)[positions // self.shape.block_tokens]
        return self.talker_rows[blocks, positions % self.shape.block_tokens]

    def to_host(self, table: BlockTable, rows: int) -> HostCopy:
        """A copy of the sequence's first `rows` rows in host memory of its own, never a view of the
        pool (on the CPU `.to("cpu")` alone would be one), whose blocks other sequences overwrite: a
        preempted request's rows where the host arena (host_arena.py) has no room for them.

        The KV is gathered on the device first, then moved in one transfer, and waited for: an
        asynchronous copy needs pinned memory, which torch's caching allocator rounds up to a power
        of two and keeps pinned."""
        index = self.device_table(table[: self.shape.blocks_for(rows)])[None]
        kv, scales = (_host_rows(pools, index, rows) if pools else None for pools in self._layer_pools())
        talker_rows = None
        if self.talker_rows is not None:
            talker_rows = self.talker_rows[index[0]].flatten(0, 1)[:rows].to("cpu", copy=True)
        return HostCopy(kv, talker_rows, scales)

    def from_host(self, host: HostCopy, table: BlockTable, rows: int) -> None:
        _, blocks, offsets = self.addresses(self.device_table(table), 0, rows)
        for pools, moved in zip(self._layer_pools(), (host.kv, host.scales)):
            if pools:
                on_device = moved[:, :, :, :rows].to(self.device)
                for i, (k, v) in enumerate(pools):
                    k[blocks, :, offsets] = on_device[i, 0].transpose(0, 1)
                    v[blocks, :, offsets] = on_device[i, 1].transpose(0, 1)
        if self.talker_rows is not None:
            self.talker_rows[blocks, offsets] = host.talker_rows[:rows].to(self.device)

    def device_table(self, table: BlockTable | torch.Tensor) -> torch.Tensor:
        """`table` as a device tensor (one already is: the code predictor's, made once, since a copy
        from the host inside a graph's capture would be replayed from memory since reused)."""
        if isinstance(table, torch.Tensor):
            return table
        return to_device(torch.tensor(table, dtype=torch.long), self.device)

    def addresses(self, table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequence's rows [start, end), and the block and the row in it of each, device tensors,
        from its `table` on the device."""
        rows = torch.arange(start, end, device=self.device)
        return rows, table[rows // self.shape.block_tokens], rows % self.shape.block_tokens

    def _zero(self, blocks: BlockTable) -> None:
        if blocks:
            index = to_device(torch.tensor(blocks, dtype=torch.long), self.device)
            for per_row in self._per_row():
                per_row.index_fill_(2, index, 0)
            if self.talker_rows is not None:
                self.talker_rows.index_fill_(0, index, 0)

    def _per_row(self) -> list[torch.Tensor]:
        """The tensors [2, layers, blocks, kv_heads, block_tokens, ...] of the KV's rows: the keys and
        values (an fp8 store's as bytes), and an fp8 store's scales."""
        return [self._layers] + ([self._scales] if self._scales is not None else [])

    def _layer_pools(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each layer's (key pool, value pool) [blocks, kv_heads, block_tokens, head_dim], and an fp8
        store's (key scales, value scales) as [blocks, kv_heads, block_tokens, 1] (none else)."""
        return (list(zip(self.keys, self.values)),
                [(k[..., None], v[..., None]) for k, v in self.scales] if self.scales is not None else [])

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a block as its first dimension (an fp8 store's keys and values as bytes)."""
        return [t for per_row in self._per_row() for t in per_row.flatten(0, 1).unbind()] + (
            [self.talker_rows] if self.talker_rows is not None else [])


def _host_rows(pools: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor, rows: int) -> torch.Tensor:
    """[layers, 2, kv_heads, rows, d]: the first `rows` rows of the blocks `index` [1, n] of each
    layer's (key pool, value pool), gathered on the device, then moved to the host in one transfer."""
    rows_of = [torch.stack([gathered(k, index)[0, :, :rows], gathered(v, index)[0, :, :rows]]) for k, v in pools]
    return torch.stack(rows_of).to("cpu")


class _Writer:
    """What both writers share: a store, and the kernel that reads its blocks in place (or None)."""

    store: KVStore
    kernel: PagedAttention | None

    @property
    def attends_in_place(self) -> bool:
        return self.kernel is not None

    def pools(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s key and value pools, which the layer writes its new rows into."""
        return self.store.keys[layer_idx], self.store.values[layer_idx]

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer_idx`'s key and value scales, an fp8 store's (kv_fp8.write_rows writes them); None else."""
        return self.store.scales[layer_idx] if self.store.scales is not None else None

    def gathered_rows(self, layer_idx: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, n * block_tokens, head_dim] of the n blocks of each `tables` row
        [B, n], in the model's dtype."""
        key_scales, value_scales = self.scales(layer_idx) or (None, None)
        keys, values = self.pools(layer_idx)
        dtype = self.store.dtype
        return gathered_rows(keys, key_scales, tables, dtype), gathered_rows(values, value_scales, tables, dtype)


class KVWriter(_Writer):
    """The cache of one forward of one sequence: where its new rows go, and what attention reads.

    A decoder layer (decoder_stack.py) writes its new tokens' keys and values ([1, kv_heads, n,
    head_dim]) at rows [start, start + n) of the sequence (`pools`, `places`), then either hands
    transformers' attention every row the new tokens may attend to, gathered from the blocks
    (`attended_rows`), or, given a `kernel`, has it read the blocks in place (`attend`).
    """

    def __init__(self, store: KVStore, table: BlockTable | torch.Tensor, start: int,
                 kernel: PagedAttention | None = None) -> None:
        self.store, self.table, self.start, self.kernel = store, store.device_table(table), start, kernel
        self._placed: _Placed | None = None

    def places(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's blocks and offsets [length] of this forward's new rows."""
        placed = self._place(length)
        return placed.blocks, placed.offsets

    def attended_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """Every row up to the new ones', written already: [1, kv_heads, end, head_dim] each."""
        keys, values = self.gathered_rows(layer_idx, self._placed.table[None])
        end = self._placed.end
        return keys[:, :, :end], values[:, :, :end]

    def attend(self, queries: torch.Tensor, layer_idx: int, scaling: float, norm_rope: QueryNormRope | None = None
               ) -> torch.Tensor:
        """The attention [1, n, heads, head_dim] of `queries` [1, heads, n, head_dim] (to be normed and
        rotated by `norm_rope` where given), its rows written already."""
        placed = self._placed
        return self.kernel(queries, *self.pools(layer_idx), placed.table[None], placed.rows[None], scaling,
                           norm_rope=norm_rope, scales=self.scales(layer_idx))

    def _place(self, length: int) -> "_Placed":
        """Where this forward's `length` new rows go, worked out once for all its layers."""
        end = self.start + length
        if self._placed is None or self._placed.end != end:
            shape = self.store.shape
            if end > shape.max_tokens or shape.blocks_for(end) > self.table.shape[0]:
                raise IndexError(f"the sequence holds {self.table.shape[0] * shape.block_tokens} rows, "
                                 f"asked to write up to {end}")
            self._placed = _Placed(end, *self.store.addresses(self.table, self.start, end),
                                   self.table[: shape.blocks_for(end)])
        return self._placed

    def attention_mask(self, implementation: str, length: int, like: torch.Tensor) -> torch.Tensor | None:
        """The mask for the `length` new tokens over the rows `attended_rows` hands back (none for the kernel)."""
        if self.kernel is not None:
            return None
        return causal_mask(implementation, self.start, length, like)

    def last_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, 1, hidden] of [1, n, hidden]: the last new token's, whose output is wanted."""
        return hidden[:, -1:]


class PackedKVWriter(_Writer):
    """The cache of one forward of several sequences' new tokens packed into one row ([1, n_1 + ... +
    n_B]): a prefill of prompts that arrived together, whose per-token work (projections, MoE
    experts, norms) then runs once for all of them, reading the experts' weights once.

    Attention does not mix sequences: `parts` hands each sequence's own KVWriter and its slice of
    the packed tokens, and the layer attends part by part, each exactly as the sequence's forward
    alone would (its mask, its rows, its kernel call).
    """

    def __init__(self, writers: list[KVWriter], lengths: list[int]) -> None:
        first = writers[0]
        self.store, self.kernel, self.writers = first.store, first.kernel, writers
        self.slices = self.slices_of(lengths)
        self._lasts = to_device(torch.tensor([part.stop - 1 for part in self.slices]), self.store.device)
        self._places: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def slices_of(lengths: list[int]) -> list[slice]:
        """Where each sequence's new tokens are among the packed ones, given how many each has."""
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        return [slice(end - n, end) for end, n in zip(ends, lengths)]

    def parts(self) -> list[tuple[KVWriter, slice]]:
        """Each sequence's writer, and where its new tokens are among the packed ones."""
        return list(zip(self.writers, self.slices))

    def places(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's blocks and offsets [n_1 + ... + n_B] of every sequence's new rows, in order."""
        if self._places is None:
            placed = [writer.places(part.stop - part.start) for writer, part in self.parts()]
            self._places = torch.cat([blocks for blocks, _ in placed]), torch.cat([offsets for _, offsets in placed])
        return self._places

    def attention_mask(self, implementation: str, length: int, like: torch.Tensor) -> list[torch.Tensor | None]:
        """Each sequence's own mask, in order (its writer's, for its new tokens)."""
        return [writer.attention_mask(implementation, part.stop - part.start, like) for writer, part in self.parts()]

    def last_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, 1, hidden] of [1, n_1 + ... + n_B, hidden]: each sequence's last new token's."""
        return hidden[0, self._lasts, None]


@dataclass(frozen=True)
class _Placed:
    """Where a forward's new rows go: its end, their rows [n] in the sequence, their blocks and offsets
    [n] in the pool, and the sequence's table up to the end, all on the device."""

    end: int
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    table: torch.Tensor


NO_PREFIX = 0  # a graph's attention rows when its new tokens are their sequences' first (GraphedKVWriter)


class GraphedKVWriter(_Writer):
    """The `cache` of a forward captured in a CUDA graph: B sequences of L new tokens each (B > 1:
    several chats decoding together; L > 1: a short prefill).

    Device tensors read when the graph replays, so one graph serves every sequence and position:
    `tables` [B, blocks] (each sequence's block table, from its first block; a graph reads the
    `rows` // block_tokens first), `indices` [B, L] (each new token's row in its sequence), `blocks`
    and `offsets` [B, L] (where that row is in the pool) and `last` [B] (which new token's output is
    wanted). `attended_rows` hands back each sequence's first `rows` rows (the graph's bucket), not the
    filled length, whose size a graph cannot change; the mask hides the rows after each new token,
    which is enough only because those rows hold numbers: zeros, or the session's own (a store for
    graphs zeroes the blocks it hands out). Given a `kernel`, a forward instead `attend`s: the rows
    are written and the kernel reads the bucket's blocks in place, each token's own rows only.

    With `rows` = NO_PREFIX the new tokens are their sequences' first: `attended_rows` hands back their
    own keys and values and no mask, so attention is causal over them alone, as in transformers'
    own prefill (flash attention's kernel, which skips the rows after each token and gathers
    nothing, where a bucket's mask would have every token read every row of the bucket). A padded
    prefill's extra tokens come after the real ones, so no real token attends to them.
    """

    def __init__(self, store: KVStore, tables: torch.Tensor, indices: torch.Tensor, blocks: torch.Tensor,
                 offsets: torch.Tensor, last: torch.Tensor, rows: int, kernel: PagedAttention | None = None
                 ) -> None:
        assert kernel is None or rows != NO_PREFIX, "the kernel reads the blocks: it needs their rows"
        self.store, self.indices, self.blocks, self.offsets, self.last = store, indices, blocks, offsets, last
        self.rows = store.shape.blocks_for(rows) * store.shape.block_tokens
        self.tables = tables[:, : store.shape.blocks_for(rows)]
        self.kernel = kernel
        self._flat_places = blocks.reshape(-1), offsets.reshape(-1)

    def places(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's blocks and offsets [B * L] of the new rows (L = `length`, the graph's), sequence by
        sequence: flat views of the graph's buffers (a copy, made once a forward, where one is not)."""
        return self._flat_places

    def attended_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """What transformers' attention reads, the new rows written already: their own keys and values
        (NO_PREFIX; an fp8 store's as written, so that a first prefill reads what later turns read), or
        the bucket's rows [B, kv_heads, rows, head_dim] gathered from each sequence's blocks."""
        if self.rows == NO_PREFIX:
            if self.store.scales is None:
                return key_states, value_states
            return self._written(layer_idx, key_states.shape)
        return self.gathered_rows(layer_idx, self.tables)

    def attend(self, queries: torch.Tensor, layer_idx: int, scaling: float, norm_rope: QueryNormRope | None = None
               ) -> torch.Tensor:
        """The attention [B, L, heads, head_dim] of `queries` [B, heads, L, head_dim] (to be normed and
        rotated by `norm_rope` where given), its rows written already."""
        return self.kernel(queries, *self.pools(layer_idx), self.tables, self.indices, scaling, norm_rope=norm_rope,
                           scales=self.scales(layer_idx))

    def _written(self, layer_idx: int, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [B, kv_heads, L, head_dim] (`shape`) this forward wrote, read back from an
        fp8 store at their places."""
        batch, kv_heads, length, head_dim = shape
        blocks, offsets = self._flat_places
        return tuple(read_rows(pool[blocks, :, offsets], scales[blocks, :, offsets], self.store.dtype)
                     .view(batch, length, kv_heads, head_dim).transpose(1, 2)
                     for pool, scales in zip(self.pools(layer_idx), self.scales(layer_idx)))

    def attention_mask(self, implementation: str, length: int, like: torch.Tensor) -> torch.Tensor | None:
        if self.kernel is not None or self.rows == NO_PREFIX:
            return None  # the kernel reads each token's own rows only; the new tokens alone are causal
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
