"""Choosing the next token of each sequence from its logits: on the device, a whole batch at once.

Each row has its own parameters (greedy or sampled; temperature, top-k, top-p, repetition penalty)
and its own random numbers: a key hashed on the host from the request's seed and the token's index
in the reply, then one uniform number per token id hashed from the key and the id with integer
tensor ops. So a seed reproduces its reply whatever else shares the batch, on the CPU or a GPU, and
no generator state follows a request around. A sampled token is a Gumbel-max draw: the best of the
filtered scores plus Gumbel noise picks each token with its softmax probability. Nothing here reads
a value back from the device: the Thinker's decode steps hand their tokens to the next step there,
and the engine reads them one step late.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from typing import TypeVar

import torch

from omni_local.engine.memory.host_copies import to_device
from omni_local.kernels.sampling.hash32 import HASH_MULTIPLIERS, HASH_SHIFTS, UNIFORM_BITS
from omni_local.kernels.triton_support import uses_triton
from omni_local.protocol.params import SamplingParams

_LOW32 = 0xFFFFFFFF
T = TypeVar("T", int, torch.Tensor)


@dataclass(frozen=True)
class SamplingRows:
    """Sampling parameters and state, one row per sequence, as device tensors."""

    temperature: torch.Tensor  # [B] float32; 0: greedy
    top_k: torch.Tensor  # [B] long; 0: no limit
    top_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32: the repetition penalty; 1: none
    seen: torch.Tensor  # [B, vocab] bool: the prompt's ids and the reply's so far

    @classmethod
    def empty(cls, rows: int, vocab: int, device: torch.device) -> "SamplingRows":
        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(rows), zeros(rows, dtype=torch.long), zeros(rows) + 1, zeros(rows) + 1,
                   zeros(rows, vocab, dtype=torch.bool))

    def select(self, rows: torch.Tensor) -> "SamplingRows":
        """The rows `rows` [B] (a device tensor), in that order."""
        return SamplingRows(*(getattr(self, field.name).index_select(0, rows) for field in fields(self)))


@dataclass(frozen=True)
class SampleBatch:
    """Whose rows the logits of one forward are: a seat per row, and the key of each row's random
    numbers (from its seed and the index in its reply of the token it chooses)."""

    seats: torch.Tensor  # [B] long, on the device
    keys: torch.Tensor  # [B] long (32-bit values), on the device
    sampling: bool  # some row samples; False (every row greedy, known on the host) skips the sampling maths
    limits_reasoning: bool = False  # some row's reasoning has a limit; False skips that maths


class SeatSampler:
    """The sampling rows of every seat, on the device: a running request's row here is its seat
    (engine/seats.py), wherever its KV is. A request's parameters, seed and prompt ids
    go to its seat's row at its prefill (`start`); the logits of a forward are sampled with its seats'
    rows (`sample`), which also marks each chosen token seen and keeps it as its seat's next input
    (`inputs`): the next decode step reads it there, without the host."""

    def __init__(self, seats: int, vocab: int, device: torch.device, suppressed: torch.Tensor | None = None,
                 reasoning_end: int | None = None) -> None:
        """`reasoning_end`: the id that ends a reasoning block (`</think>`), for a Thinking checkpoint."""
        self.device = device
        self.rows = SamplingRows.empty(seats, vocab, device)
        self.last = torch.zeros(seats, dtype=torch.long, device=device)  # each seat's last chosen token
        self.suppressed = suppressed  # [n] ids never chosen, on the device
        self.reasoning_end = reasoning_end
        # Per seat: reasoning tokens its reply may still choose before its block is ended for it; -1:
        # no limit, or not reasoning. Kept on the device, since the host reads each token a step late.
        self.reasoning_left = torch.full((seats,), -1, dtype=torch.long, device=device)
        self._token_keys = _hash32(torch.arange(vocab, device=device))  # what each id adds to a row's key
        self._uniform_numbers = _uniform_numbers_on(device)
        self._draw = _fused_draw_on(device, vocab)
        self._suppressed_mask = None  # the one-kernel draw's: [vocab] True where an id is suppressed
        if self._draw is not None and suppressed is not None:
            self._suppressed_mask = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, suppressed, True)
        # On the host, per seat: whether its request samples, and its seed.
        self._sampling, self._seeds = [False] * seats, [0] * seats
        self._limits_reasoning = [False] * seats

    @torch.inference_mode()
    def start(self, seat: int, params: SamplingParams, seed: int, prompt_ids: torch.Tensor | None = None,
              reasoning_limit: int = 0) -> None:
        """Give `seat`'s row to a new request: its parameters, its seed, its prompt's ids (on the host;
        None: no ids seen yet) as seen, and how many tokens it may reason for (its prompt opened a
        reasoning block; 0: no limit)."""
        # Each value is a kernel's argument (fill_): assigned (`row[seat] = value`), it would be a copy
        # from the host's memory, which waits for all the work queued on the device.
        rows = self.rows
        rows.temperature[seat].fill_(params.temperature)
        rows.top_k[seat].fill_(min(params.top_k, rows.seen.shape[1]))  # any more is the whole vocabulary
        rows.top_p[seat].fill_(params.top_p)
        rows.penalty[seat].fill_(params.repetition_penalty)
        rows.seen[seat].zero_()
        if prompt_ids is not None:
            rows.seen[seat].index_fill_(0, to_device(prompt_ids, self.device), True)
        self.reasoning_left[seat].fill_(reasoning_limit if reasoning_limit > 0 else -1)
        self._limits_reasoning[seat] = reasoning_limit > 0
        self._sampling[seat], self._seeds[seat] = not params.greedy, seed

    def batch(self, seats: list[int], draws: list[int]) -> SampleBatch:
        """Rows for the seats `seats`, choosing token `draws[i]` of each reply; sent without waiting."""
        sampling = any(self._sampling[seat] for seat in seats)
        keys = [_draw_key(self._seeds[seat], draw) if sampling else 0 for seat, draw in zip(seats, draws)]
        on_device = to_device(torch.tensor([seats, keys]), self.device)
        return SampleBatch(on_device[0], on_device[1], sampling, any(self._limits_reasoning[seat] for seat in seats))

    def inputs(self, batch: SampleBatch) -> torch.Tensor:
        """[B] the last token chosen in each seat of `batch`: the input of its next decode step."""
        return self.last.index_select(0, batch.seats)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """The tokens [B] chosen from `logits` [B, vocab] float32, on the device: repeats penalised,
        sampled rows over their temperature, suppressed ids out, then the best (greedy rows, exactly
        as argmax picks it, ties to the first) or a draw (the others). On a GPU a small vocabulary's
        (the Talker's) is one kernel (kernels/sampling/fused_draw.py), the rest tensor ops."""
        if self._draw is not None and not batch.limits_reasoning:
            rows = self.rows
            return self._draw(logits, batch.seats, batch.keys, rows.temperature, rows.top_k, rows.top_p, rows.penalty,
                              rows.seen, self._suppressed_mask, self._token_keys, self.last, batch.sampling)
        rows = self.rows.select(batch.seats)
        scores = _penalize_repeats(logits, rows.seen, rows.penalty)
        if batch.sampling:  # a greedy row's scores stay as they are (over 1)
            scores = scores / torch.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
        # Suppressed after all arithmetic, so a suppressed id's -inf stays -inf whatever the scaling did
        # to the other scores (an -inf scaled can turn into a NaN, which argmax picks).
        if self.suppressed is not None:
            scores = scores.index_fill(1, self.suppressed, float("-inf"))
        tokens = scores.argmax(dim=-1)
        if batch.sampling:
            noise = _gumbel(self._uniform_numbers(batch.keys, self._token_keys))
            drawn = (_filtered(scores, rows) + noise).argmax(dim=-1)
            tokens = torch.where(rows.temperature > 0, drawn, tokens)
        if batch.limits_reasoning:
            tokens = self._end_reasoning_at_limit(tokens, batch.seats)
        self.rows.seen.index_put_((batch.seats, tokens), torch.ones_like(tokens, dtype=torch.bool))
        self.last.index_copy_(0, batch.seats, tokens)
        return tokens

    def _end_reasoning_at_limit(self, tokens: torch.Tensor, seats: torch.Tensor) -> torch.Tensor:
        """`tokens` with the end of the reasoning block in place of the choice of each row that has
        reasoned as long as it may; the rows' counts taken down (-1 once their block has ended)."""
        left = self.reasoning_left.index_select(0, seats)
        tokens = torch.where(left == 0, self.reasoning_end, tokens)
        left = torch.where(tokens == self.reasoning_end, -1, left - (left > 0).long())
        self.reasoning_left.index_copy_(0, seats, left)
        return tokens


class Sampler:
    """One stream of tokens, each chosen on the device and left there (the Talker's first code of
    each frame, which the code predictor reads there, the host reading it with the frame's other
    codes): the rule of SeatSampler on a table of one row, made at the first token (whose logits
    give the vocabulary)."""

    def __init__(
        self, params: SamplingParams, seed: int, prompt_ids: torch.Tensor | None = None,
        suppressed: torch.Tensor | None = None
    ) -> None:
        self._start = (params, seed, prompt_ids)
        self._suppressed = suppressed
        self._table: SeatSampler | None = None
        self._chosen = 0

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The token [1] chosen from `logits` [vocab] float32, on their device, unread."""
        if self._table is None:
            self._table = SeatSampler(1, logits.shape[-1], logits.device, self._suppressed)
            self._table.start(0, *self._start)
        token = self._table.sample(logits[None], self._table.batch([0], [self._chosen]))
        self._chosen += 1
        return token


def _penalize_repeats(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # The CTRL rule, as transformers applies it: shrink the scores of tokens already present. A
    # penalty of 1 changes nothing (x * 1 and x / 1 are x exactly).
    p = penalty[:, None]
    return torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)


def _filtered(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """`scores` [B, vocab] (already over each row's temperature), -inf outside its top-k, then
    outside its top-p, as transformers' warpers keep them: ties with the k-th best stay; a token goes
    once the mass before it reaches top_p, and the best always stays."""
    ordered, order = scores.sort(dim=-1, descending=True)
    k = torch.where(rows.top_k > 0, rows.top_k, scores.shape[-1])
    ordered = ordered.masked_fill(ordered < ordered.gather(1, k[:, None] - 1), float("-inf"))
    probs = ordered.softmax(dim=-1)
    tail = (probs.cumsum(dim=-1) - probs >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]
    ordered = ordered.masked_fill(tail, float("-inf"))
    return torch.empty_like(ordered).scatter(1, order, ordered)


def _draw_key(seed: int, draw: int) -> int:
    """The key of the random numbers for token `draw` of the reply seeded `seed`."""
    return _hash32((seed & _LOW32) ^ _hash32(((seed >> 32) & _LOW32) ^ _hash32(draw & _LOW32)))


def _gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from uniform numbers."""
    return -torch.log(-torch.log(uniform))


UniformNumbers = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def uniform_numbers(keys: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """[B, vocab] float32 strictly inside (0, 1), each a function of its row's key [B] and its
    token's [vocab] only."""
    return _uniform(_hash32(keys[:, None] ^ token_keys))


@cache  # a spoken reply makes a sampler of its own: the kernel is compiled and run once a process
def _uniform_numbers_on(device: torch.device) -> UniformNumbers:
    """`uniform_numbers` as `device` makes them fastest, the same bits: one Triton kernel on a GPU
    that runs it (compiled here, not at a first sampled reply), tensor ops elsewhere."""
    if not uses_triton("sampling", "auto", device):
        return uniform_numbers
    from omni_local.kernels.sampling.uniform_noise import kernel_uniform_numbers  # imports triton

    kernel_uniform_numbers(torch.zeros(1, dtype=torch.long, device=device),
                           torch.zeros(1, dtype=torch.long, device=device))
    return kernel_uniform_numbers


def _fused_draw_on(device: torch.device, vocab: int) -> Callable[..., torch.Tensor] | None:
    """kernels/sampling/fused_draw.py's one-kernel draw where `device` runs our Triton kernels and one
    program holds `vocab` (the Talker's and its code predictor's vocabularies, not the Thinker's);
    None: the tensor ops."""
    if not uses_triton("sampling", "auto", device):
        return None
    from omni_local.kernels.sampling.fused_draw import MOST_VOCAB, fused_draw  # imports triton

    return fused_draw if vocab <= MOST_VOCAB else None


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 numbers strictly inside (0, 1) from 32-bit values: their top 23 bits, exactly. (With 24,
    the largest would round to 1, its Gumbel noise be infinite, and a filtered-out token's -inf
    plus it NaN, which argmax picks.)"""
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) / 2**UNIFORM_BITS


def _hash32(x: T) -> T:
    """A bijective mix of 32-bit values, Python ints or int64 tensors: kernels/sampling/hash32.py's."""
    first, second, third = HASH_SHIFTS
    x = x ^ (x >> first)
    x = _mul32(x, HASH_MULTIPLIERS[0])
    x = x ^ (x >> second)
    x = _mul32(x, HASH_MULTIPLIERS[1])
    return x ^ (x >> third)


def _mul32(x: T, c: int) -> T:
    """(x * c) mod 2**32 for 32-bit x and c: c taken in 16-bit halves, so no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _LOW32
