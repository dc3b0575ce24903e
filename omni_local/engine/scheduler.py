"""The scheduler: who runs and what each engine turn computes, decided from the requests, the seats
and the prefix cache's blocks; the engine does the work (forwards, sampling, streaming). It never
touches a tensor, and is tested without a model (tests/unit/test_scheduler.py).

Admission (`admit`) takes waiting requests in order while a seat and blocks can be had: a request
claims its blocks through the prefix cache, and one that finds too few stops the line until a
running request gives blocks back. A preempted (parked) request resumes before any newer one starts.
Those left in line learn their place (`moved_in_line`): the first waits for one running reply (its
seat or its blocks), each next one for one more.

A turn's plan (`plan`) is a value: the running requests cancelled, the prefill parts to compute, the
requests to decode. A prefill is computed in chunks of prefill_chunk_tokens while another reply
decodes or speaks (prefill_chunks.py), else in forwards of prefill_forward_tokens; after the oldest
prompt's part, each next prompt whose last part fits in the turn's forward is computed too (in that
one forward: the engine packs a turn's parts), and none overtakes an older one. So many short first
questions at once get their first tokens together, the experts' weights read once for all of them,
and the replies already decoding wait no longer for them than for one chunk of a long prompt.

Each decoding request needs a block for the row its step writes (`make_room`): a written reply
claims its rows REPLY_ROWS_AHEAD at a time; where no block can be had, the youngest written reply
decoding is parked (its rows to host memory, its seat kept) until blocks free. A spoken reply
claims its every row at admission and is never parked: its Talker reads the Thinker's rows.
"""

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omni_local.engine.forward.prefill_chunks import chunk_end
from omni_local.engine.memory.prefix_cache import Claim, PrefixCache
from omni_local.engine.phases import CLAIM_KV, phase
from omni_local.engine.request import Request, State
from omni_local.engine.seats import Seats
from omni_local.settings import EngineConfig

log = logging.getLogger(__name__)
REPLY_ROWS_AHEAD = 64  # a written reply's KV rows claimed at a time: after its prompt, then as it outgrows them


@dataclass(frozen=True)
class Admission:
    """What one admission did: the waiting requests it took, in order, each with its claim and seat."""

    admitted: tuple[Request, ...]
    cancelled: tuple[Request, ...]  # cancelled while waiting: to finish
    failed: tuple[tuple[Request, Exception], ...]  # no prompt, or no claim: to fail with why


@dataclass(frozen=True)
class Part:
    """A prefill forward: `request`'s prompt rows from where its blocks' rows end up to `end`."""

    request: Request
    end: int


@dataclass(frozen=True)
class TurnPlan:
    """What one engine turn does, in this order: finish the cancelled, compute the prefill parts,
    then one decode step of the decoding (each given its row's block by `make_room`)."""

    cancelled: tuple[Request, ...]
    prefills: tuple[Part, ...]
    decoding: tuple[Request, ...]  # in order of admission


class Scheduler:
    def __init__(self, settings: EngineConfig, cache: PrefixCache, seats: Seats, block_tokens: int) -> None:
        self.settings, self.cache, self.seats, self.block_tokens = settings, cache, seats, block_tokens
        self.waiting: deque[Request] = deque()  # their prompts built, in the order they came
        self.running: list[Request] = []  # admitted and not ended, in order of admission
        self._short_of_blocks = False  # the first waiting request found too few blocks

    def blocks_freed(self) -> None:
        """A running request gave blocks back: the first waiting request may find enough now."""
        self._short_of_blocks = False

    def drop_ended(self) -> None:
        """The running requests that ended (finished or failed) leave."""
        self.running = [r for r in self.running if not r.ended]

    def parked(self) -> list[Request]:
        """The preempted requests, oldest first."""
        return [r for r in self.running if r.state is State.PARKED]

    def admit(self) -> Admission:
        """Take waiting requests in order while seats and blocks can be had; the rest wait their turn."""
        cancelled = tuple(r for r in self.waiting if r.cancelled.is_set())
        for request in cancelled:
            self.waiting.remove(request)
        admitted: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        # A parked request resumes before any newer one starts: it would take the blocks freed.
        while self.waiting and not self._short_of_blocks and self.seats.free and not self.parked():
            request = self.waiting[0]
            try:
                if request.build_error is not None:
                    raise request.build_error
                request.claim = self._claim(request)
            except Exception as error:  # noqa: BLE001 - one request's failure must not stop the others
                self.waiting.popleft()
                failed.append((request, error))
                continue
            if request.claim is None:
                # Running requests hold the blocks it needs: matching again before one lets go would
                # only repeat the same work at every decode step.
                self._short_of_blocks = True
                break
            self.waiting.popleft()
            request.seat = self.seats.take()
            request.admit()
            self.running.append(request)
            admitted.append(request)
        return Admission(tuple(admitted), cancelled, tuple(failed))

    def moved_in_line(self) -> list[Request]:
        """The waiting requests whose place changed since last asked (or who were never told one), each
        with `ahead` set to the replies before it: those ahead of it in line, and the running one whose
        seat or blocks the first in line waits for. Asked after `admit`, when all left in line wait."""
        moved = []
        for ahead, request in enumerate(self.waiting, start=1):
            if request.ahead != ahead:
                request.ahead = ahead
                moved.append(request)
        return moved

    def _claim(self, request: Request) -> Claim | None:
        with phase(CLAIM_KV):
            match = self.cache.match(request.prompt, request.session, request.principal)
            return self.cache.claim(request.session, request.prompt, match, self.claimed_rows(request),
                                    at_most=self.rows_for(request), principal=request.principal)

    def rows_for(self, request: Request) -> int:
        """KV rows `request` may write: its prompt and its longest reply, within the context."""
        return min(request.prompt.num_tokens + request.params.max_new_tokens, self.settings.max_context_tokens)

    def claimed_rows(self, request: Request) -> int:
        """KV rows claimed at admission: a written reply's prompt and first REPLY_ROWS_AHEAD rows (it
        grows as it goes, `make_room`); a spoken reply's every row, as it is never parked."""
        most = self.rows_for(request)
        return most if request.speech is not None else min(most, request.prompt.num_tokens + REPLY_ROWS_AHEAD)

    def plan(self) -> TurnPlan:
        """This turn's plan. A request whose rows are still coming back from host memory sits it out."""
        flagged = [(r, r.cancelled.is_set()) for r in self.running]
        cancelled = tuple(r for r, flag in flagged if flag)
        live = [r for r, flag in flagged if not flag]
        ready = [r for r in live if r.state in (State.PREFILLING, State.DECODING) and r.claim.ready]
        decoding = tuple(r for r in ready if r.state is State.DECODING)
        prefilling = [r for r in ready if r.state is State.PREFILLING]
        # Those a long prefill would hold up: the replies decoding and the ones still speaking (a
        # prompt waiting for its own prefill comes after this one's, in chunks or not).
        in_chunks = bool(decoding) or any(r.speaking for r in live) or self.settings.chunk_every_prefill
        return TurnPlan(cancelled, self._parts(prefilling, in_chunks), decoding)

    def _parts(self, prefilling: list[Request], in_chunks: bool) -> tuple[Part, ...]:
        """The oldest prompt's next part, then, in order, each next prompt that its last part
        finishes while the turn's prefills stay within one forward's tokens: prefill_chunk_tokens
        `in_chunks`, else prefill_forward_tokens (the engine computes a turn's parts in one forward)."""
        settings = self.settings
        budget = settings.prefill_chunk_tokens if in_chunks else settings.prefill_forward_tokens
        parts = []
        for request in prefilling:
            begin, end = request.prefilled, self._part_end(request, in_chunks)
            if parts and (end < request.prompt.num_tokens or end - begin > budget):
                break  # it waits for a turn of its own: no prompt overtakes an older one
            parts.append(Part(request, end))
            budget -= end - begin
        return tuple(parts)

    def _part_end(self, request: Request, in_chunks: bool) -> int:
        """Where `request`'s next prefill part ends: `in_chunks`, at the next multiple of
        prefill_chunk_tokens; else of prefill_forward_tokens (or at the end of its prompt)."""
        # Chunks only buy other replies shorter waits, and cost the prompt time: each is a forward of
        # its own, reading the experts' weights again. So a prompt that holds up nobody is one forward
        # of as many tokens as a graph holds. Chosen again each turn: a prompt begun in chunks
        # finishes in such forwards once nobody else decodes or speaks, from where a chunk ended, so
        # every part of it still ends at a multiple of the chunk size, fixed by position whatever the
        # cache supplied and whoever else ran.
        settings = self.settings
        size = settings.prefill_chunk_tokens if in_chunks else settings.prefill_forward_tokens
        return chunk_end(request.prefilled, request.prompt.num_tokens, size)

    def make_room(self, decoding: Sequence[Request], drain: Callable[[], None]) -> list[Request]:
        """The requests to decode this turn, each with blocks for the row its step writes. Oldest
        first, each one whose next row is past its blocks is grown by REPLY_ROWS_AHEAD rows; where no
        block can be had, the step in flight is read (`drain`: a request is parked with no step in
        flight, its rows all known), which may end replies and give their blocks back; if still none
        can, the youngest written reply decoding is parked until one can, the growing request itself
        if it is that one. Then parked ones come back, oldest first,
        while blocks are left (so none is parked again at once)."""
        for request in [r for r in decoding if r.launched < r.max_new_tokens]:
            if request.state is not State.DECODING:  # parked for an older one's block, or ended by a drained step
                continue
            rows = self.next_rows(request)
            if self.cache.grow(request.claim, rows):
                continue
            drain()  # which may end requests, and so free blocks: the grow is tried again before any park
            while request.state is State.DECODING and not self.cache.grow(request.claim, rows):
                self._park(youngest_written(decoding))
        room = [r for r in decoding if r.state is State.DECODING]
        for request in self.parked():
            if not self.cache.resume(request.claim, self.next_rows(request)):
                break
            request.move(State.DECODING)
            if request.claim.ready:
                room.append(request)
        return room

    def next_rows(self, request: Request) -> int:
        """Rows `request` must hold for its next step, which writes row prompt + launched - 1: those,
        and REPLY_ROWS_AHEAD more (within its longest reply) where its blocks end before them."""
        rows = request.prompt.num_tokens + request.launched
        held = len(request.table) * self.block_tokens if request.table is not None else 0
        return rows if rows <= held else min(rows + REPLY_ROWS_AHEAD, self.rows_for(request))

    def _park(self, request: Request) -> None:
        """Preempt `request` (a written reply decoding, no step of it in flight): what it wrote is
        published, its rows go to host memory and its blocks to the pool. It keeps its seat, and with
        it its sampler's state (its last token, its random stream), and resumes where it stopped."""
        self.cache.publish(request.claim, request.prompt, request.output_ids, request.written)
        self.cache.park(request.claim, request.written)
        request.move(State.PARKED)
        log.info("KV full: a reply of %d tokens waits in host memory for blocks to free", request.written)


def youngest_written(decoding: Sequence[Request]) -> Request:
    """The request to park for a block: the last admitted of the written replies still decoding."""
    return max((r for r in decoding if r.state is State.DECODING and r.speech is None), key=lambda r: r.started_at)
