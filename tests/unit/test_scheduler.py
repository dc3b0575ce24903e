"""The scheduler's policies without a model: admission, a turn's prefill parts and decode set, and
parking when blocks run out, over a prefix cache faked as a count of free blocks."""

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from omni_local.engine.memory.prefix_cache import Claim, Entry
from omni_local.engine.request import Request, State
from omni_local.engine.scheduler import Part, Scheduler, TurnPlan
from omni_local.engine.seats import Seats
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.settings import Settings

BLOCK = 16
CHUNK = 16  # prefill_chunk_tokens
FORWARD = 64  # prefill_forward_tokens
SETTINGS = Settings(prefill_chunk_tokens=CHUNK, prefill_forward_tokens=FORWARD, max_context_tokens=1024,
                    max_prompt_tokens=960)


class Blocks:
    """The prefix cache as the scheduler sees it: blocks free or held, nothing cached, every block
    held by one claim; what was parked and published, in order."""

    def __init__(self, free: int) -> None:
        self.free, self.matches, self.parked, self.published = free, 0, [], []

    def match(self, prompt: object, session: str, principal: str) -> None:
        self.matches += 1

    def claim(self, session: str, prompt: object, match: None, rows: int, at_most: int, principal: str) -> Claim | None:
        table = self._take(-(-rows // BLOCK))
        if table is None:
            return None
        return Claim(Entry(principal, session, np.zeros(0, dtype=np.int64), {}, table=table), 0, 0, 0)

    def grow(self, claim: Claim, rows: int) -> bool:
        more = self._take(-(-rows // BLOCK) - len(claim.entry.table))
        if more is not None:
            claim.entry.table.extend(more)
        return more is not None

    def publish(self, claim: Claim, prompt: object, reply: list[int], written: int) -> None:
        self.published.append(claim)

    def park(self, claim: Claim, rows: int) -> None:
        self.parked.append(claim)
        self.give_back(claim)

    def resume(self, claim: Claim, rows: int) -> bool:
        claim.entry.table = self._take(-(-rows // BLOCK))
        return claim.entry.table is not None

    def give_back(self, claim: Claim) -> None:
        self.free += len(claim.entry.table)
        claim.entry.table = None

    def _take(self, count: int) -> list[int] | None:
        if count > self.free:
            return None
        self.free -= max(count, 0)
        return [0] * max(count, 0)


def make_scheduler(free_blocks: int, seats: int = 8) -> tuple[Scheduler, Blocks]:
    blocks = Blocks(free_blocks)
    return Scheduler(SETTINGS, blocks, Seats(seats), BLOCK), blocks


def asking(scheduler: Scheduler, prompt_tokens: int, max_new_tokens: int = 512, spoken: bool = False) -> Request:
    """A request in line, its prompt built: `prompt_tokens` long."""
    request = Request(session=f"chat {len(scheduler.waiting) + len(scheduler.running)}", messages=[],
                      params=SamplingParams(max_new_tokens=max_new_tokens), seed=0,
                      speech=SpeechParams(voice="Ethan") if spoken else None)
    request.prompt = SimpleNamespace(num_tokens=prompt_tokens)
    scheduler.waiting.append(request)
    return request


def decoding(scheduler: Scheduler, prompt_tokens: int, spoken: bool = False) -> Request:
    """A request admitted and its prompt computed: it decodes."""
    request = asking(scheduler, prompt_tokens, spoken=spoken)
    assert scheduler.admit().admitted == (request,)
    request.advance_prefill(prompt_tokens)
    request.max_new_tokens = request.params.max_new_tokens
    request.launched = 1
    return request


def admitted(scheduler: Scheduler, prompt_tokens: int) -> Request:
    request = asking(scheduler, prompt_tokens)
    assert scheduler.admit().admitted == (request,)
    return request


# A request's states ---------------------------------------------------------------------------


def test_a_request_moves_only_along_its_states():
    request = Request(session="chat", messages=[], params=SamplingParams(), seed=0)
    with pytest.raises(AssertionError, match="from WAITING to DECODING"):
        request.move(State.DECODING)
    request.move(State.TEXT_DONE)  # a request may fail or be cancelled while it waits
    request.move(State.DONE)
    with pytest.raises(AssertionError, match="from DONE to TEXT_DONE"):
        request.move(State.TEXT_DONE)


def test_a_prompt_decodes_once_its_last_part_is_in_its_blocks():
    scheduler, _ = make_scheduler(free_blocks=100)
    request = admitted(scheduler, 40)
    request.advance_prefill(16)
    assert request.state is State.PREFILLING
    request.advance_prefill(40)
    assert request.state is State.DECODING


# Admission ------------------------------------------------------------------------------------


def test_a_written_reply_claims_its_prompt_and_64_rows_and_a_spoken_one_every_row_it_may_write():
    scheduler, blocks = make_scheduler(free_blocks=100)
    written = admitted(scheduler, 20)
    assert len(written.table) == -(-(20 + 64) // BLOCK)
    spoken = asking(scheduler, 20, max_new_tokens=300, spoken=True)
    scheduler.admit()
    assert len(spoken.table) == -(-(20 + 300) // BLOCK)
    assert blocks.free == 100 - 6 - 20


def test_admission_stops_at_the_first_request_short_of_blocks_until_a_running_one_gives_blocks_back():
    scheduler, blocks = make_scheduler(free_blocks=10)
    first = asking(scheduler, 20)  # 84 rows: 6 blocks
    second = asking(scheduler, 20)
    small = asking(scheduler, 1, max_new_tokens=1)  # 1 block, but behind the second in line
    assert scheduler.admit().admitted == (first,)
    assert list(scheduler.waiting) == [second, small]
    matched = blocks.matches
    assert scheduler.admit().admitted == ()
    assert blocks.matches == matched  # not matched again at every turn while nothing was freed
    blocks.give_back(first.claim)
    scheduler.blocks_freed()
    assert scheduler.admit().admitted == (second, small)
    assert (second.state, second.seat, small.seat) == (State.PREFILLING, 1, 2)


def test_admission_waits_for_a_seat():
    scheduler, _ = make_scheduler(free_blocks=100, seats=1)
    first, second = asking(scheduler, 20), asking(scheduler, 20)
    assert scheduler.admit().admitted == (first,)
    assert list(scheduler.waiting) == [second]


def test_a_request_whose_prompt_could_not_be_built_fails_and_the_next_in_line_is_admitted():
    scheduler, _ = make_scheduler(free_blocks=100)
    broken, fine = asking(scheduler, 20), asking(scheduler, 20)
    broken.build_error = ValueError("no chat template")
    admission = scheduler.admit()
    assert admission.failed == ((broken, broken.build_error),)
    assert admission.admitted == (fine,)
    assert broken.seat is None and broken.state is State.WAITING  # the engine fails it


def test_a_request_cancelled_while_waiting_leaves_the_line_unadmitted():
    scheduler, blocks = make_scheduler(free_blocks=100)
    cancelled, fine = asking(scheduler, 20), asking(scheduler, 20)
    cancelled.cancelled.set()
    admission = scheduler.admit()
    assert (admission.cancelled, admission.admitted) == ((cancelled,), (fine,))
    assert cancelled.claim is None and blocks.free == 100 - 6


def test_no_new_request_is_admitted_while_a_reply_is_parked():
    scheduler, _ = make_scheduler(free_blocks=100)
    decoding(scheduler, 20).move(State.PARKED)
    asking(scheduler, 20)
    assert scheduler.admit().admitted == ()


# A turn's plan --------------------------------------------------------------------------------


def test_a_prompt_beside_a_decoding_reply_is_computed_one_chunk_a_turn():
    scheduler, _ = make_scheduler(free_blocks=100)
    reply = decoding(scheduler, 20)
    prompt = admitted(scheduler, 50)
    plan = scheduler.plan()
    assert plan.prefills == (Part(prompt, CHUNK),)
    assert plan.decoding == (reply,)


def test_a_prompt_that_holds_up_nobody_is_computed_in_forwards_of_prefill_forward_tokens():
    scheduler, _ = make_scheduler(free_blocks=100)
    prompt = admitted(scheduler, 150)
    assert scheduler.plan().prefills == (Part(prompt, FORWARD),)
    prompt.advance_prefill(FORWARD)
    prompt.advance_prefill(2 * FORWARD)
    assert scheduler.plan().prefills == (Part(prompt, 150),)


def test_a_prompt_begun_in_chunks_goes_on_to_the_next_forward_boundary_once_nobody_decodes():
    scheduler, _ = make_scheduler(free_blocks=100)
    prompt = admitted(scheduler, 150)
    prompt.advance_prefill(CHUNK)  # a chunk, while another reply decoded
    assert scheduler.plan().prefills == (Part(prompt, FORWARD),)


def test_a_reply_still_speaking_after_its_text_ended_makes_a_prompt_go_in_chunks():
    scheduler, _ = make_scheduler(free_blocks=100)
    speaking = decoding(scheduler, 20, spoken=True)
    speaking.spoken = SimpleNamespace(done=False)
    speaking.move(State.TEXT_DONE)
    prompt = admitted(scheduler, 50)
    plan = scheduler.plan()
    assert (plan.prefills, plan.decoding) == ((Part(prompt, CHUNK),), ())
    speaking.spoken.done = True
    assert scheduler.plan().prefills == (Part(prompt, 50),)


def test_short_prompts_after_the_oldest_share_its_turn_and_none_overtakes_an_older_one():
    scheduler, _ = make_scheduler(free_blocks=100)
    decoding(scheduler, 20)
    first, second = admitted(scheduler, 10), admitted(scheduler, 5)  # 15 of the chunk's 16 tokens
    admitted(scheduler, 3)  # does not fit in the one token left
    admitted(scheduler, 1)  # would fit, but comes after it
    assert scheduler.plan().prefills == (Part(first, 10), Part(second, 5))


def test_short_prompts_holding_up_nobody_share_a_turn_within_one_forwards_tokens():
    scheduler, _ = make_scheduler(free_blocks=100)
    prompts = [admitted(scheduler, 12) for _ in range(6)]  # five fill 60 of the forward's 64 tokens
    assert scheduler.plan().prefills == tuple(Part(prompt, 12) for prompt in prompts[:5])


def test_a_prompt_that_needs_more_than_one_part_waits_for_a_turn_of_its_own():
    scheduler, _ = make_scheduler(free_blocks=100)
    first = admitted(scheduler, 4)
    admitted(scheduler, 200)
    assert scheduler.plan().prefills == (Part(first, 4),)


def test_a_cancelled_request_is_finished_and_neither_prefilled_nor_decoded():
    scheduler, _ = make_scheduler(free_blocks=100)
    reply, prompt = decoding(scheduler, 20), admitted(scheduler, 20)
    reply.cancelled.set()
    prompt.cancelled.set()
    assert scheduler.plan() == TurnPlan((reply, prompt), (), ())


def test_a_request_whose_rows_are_coming_back_from_host_memory_sits_the_turn_out():
    scheduler, _ = make_scheduler(free_blocks=100)
    reply, prompt = decoding(scheduler, 20), admitted(scheduler, 20)
    for request in (reply, prompt):
        request.claim.loading = SimpleNamespace(finished=False)
    plan = scheduler.plan()
    assert (plan.prefills, plan.decoding) == ((), ())


# Room to decode, and parking ------------------------------------------------------------------


def outgrown(request: Request) -> Request:
    """`request`'s next step writes the first row past its blocks."""
    request.launched = len(request.table) * BLOCK - request.prompt.num_tokens + 1
    return request


def test_a_reply_within_its_blocks_decodes_without_taking_one():
    scheduler, blocks = make_scheduler(free_blocks=5)
    reply = decoding(scheduler, 16)  # 80 rows: 5 blocks
    assert scheduler.make_room([reply], drain=pytest.fail) == [reply]
    assert blocks.free == 0


def test_a_reply_that_outgrows_its_blocks_takes_64_rows_more():
    scheduler, blocks = make_scheduler(free_blocks=10)
    reply = outgrown(decoding(scheduler, 16))  # row 80 is its 81st
    assert scheduler.make_room([reply], drain=pytest.fail) == [reply]
    assert len(reply.table) == -(-(81 + 64) // BLOCK) and blocks.free == 0


def test_with_no_block_free_the_youngest_written_reply_is_parked_never_a_spoken_one():
    scheduler, blocks = make_scheduler(free_blocks=5 + 33 + 5)
    oldest = outgrown(decoding(scheduler, 16))
    spoken = decoding(scheduler, 16, spoken=True)  # every row claimed: 512 + 16 rows, 33 blocks
    youngest = decoding(scheduler, 16)
    drained = []
    room = scheduler.make_room([oldest, spoken, youngest], drain=lambda: drained.append(True))
    assert room == [oldest, spoken]
    assert (youngest.state, blocks.parked, blocks.published, drained) == (
        State.PARKED, [youngest.claim], [youngest.claim], [True])
    assert youngest.seat is not None  # it keeps its seat and sampler state


def test_the_growing_reply_parks_itself_when_it_is_the_youngest_written_one():
    scheduler, blocks = make_scheduler(free_blocks=5 + 33)
    spoken = decoding(scheduler, 16, spoken=True)
    reply = outgrown(decoding(scheduler, 16))
    assert scheduler.make_room([spoken, reply], drain=lambda: None) == [spoken]
    assert reply.state is State.PARKED and blocks.free == 5


def ended_by_the_step_in_flight(request: Request, blocks: Blocks) -> Callable[[], None]:
    """A drain: the step in flight, read now, whose token ends `request`, its blocks given back."""
    def drain() -> None:
        request.move(State.TEXT_DONE)
        blocks.give_back(request.claim)
    return drain


def test_a_reply_that_ends_at_the_step_read_early_is_not_parked():
    scheduler, blocks = make_scheduler(free_blocks=10)
    growing, other = outgrown(decoding(scheduler, 16)), decoding(scheduler, 16)
    assert scheduler.make_room([growing, other], drain=ended_by_the_step_in_flight(growing, blocks)) == [other]
    assert blocks.parked == [] and blocks.free == 5


def test_blocks_the_step_read_early_gives_back_are_taken_before_anyone_is_parked():
    scheduler, blocks = make_scheduler(free_blocks=10)
    growing, ending = outgrown(decoding(scheduler, 16)), decoding(scheduler, 16)
    assert scheduler.make_room([growing, ending], drain=ended_by_the_step_in_flight(ending, blocks)) == [growing]
    assert growing.state is State.DECODING and blocks.parked == [] and blocks.free == 0


def test_parked_replies_come_back_oldest_first_while_blocks_are_left():
    scheduler, blocks = make_scheduler(free_blocks=15)
    older, younger, other = decoding(scheduler, 16), decoding(scheduler, 16), decoding(scheduler, 16)
    for request in (older, younger):
        request.move(State.PARKED)
        blocks.give_back(request.claim)
    blocks.free = 9  # room for one of them: its next row and 64 more, 81 rows in 6 blocks
    assert scheduler.make_room([other], drain=pytest.fail) == [other, older]
    assert (older.state, younger.state) == (State.DECODING, State.PARKED)


def test_those_left_in_line_learn_their_place_and_again_only_when_it_changes():
    scheduler, _ = make_scheduler(free_blocks=100, seats=1)
    running, cancelled, second, third = (asking(scheduler, 20) for _ in range(4))
    assert scheduler.admit().admitted == (running,)
    # The first in line waits for the running reply's seat: one reply before it.
    assert [(r, r.ahead) for r in scheduler.moved_in_line()] == [(cancelled, 1), (second, 2), (third, 3)]
    assert scheduler.moved_in_line() == []  # nobody moved
    cancelled.cancelled.set()
    scheduler.admit()
    assert [(r, r.ahead) for r in scheduler.moved_in_line()] == [(second, 1), (third, 2)]
