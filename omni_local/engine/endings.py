"""How a request ends, in the engine's worker thread: its text ends (its seat and blocks go back, its
KV stays for the session's next turn), it finishes (the last event, speech done), or it fails (the
error event; a request whose logits were not numbers also has its KV scrubbed). What each does to
the prefix cache, the seats, the scheduler and the Talker is here, in one place, so the engine's
turn (engine.py) reads as the work it does and the point where each request leaves it.
"""

import time

from omni_local.engine.forward.speech import Speaker
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.engine.memory.prefix_cache import PrefixCache
from omni_local.engine.reply_text import ReplyText
from omni_local.engine.request import Failed, Request, State
from omni_local.engine.scheduler import Scheduler
from omni_local.engine.seats import Seats
from omni_local.protocol.events import StopReason

NOT_A_NUMBER = "the model's output was not a number (NaN or infinity): this request's input may be corrupt"


class Endings:
    def __init__(self, runner: ThinkerRunner, cache: PrefixCache, scheduler: Scheduler, seats: Seats,
                 speaker: Speaker | None, text: ReplyText) -> None:
        self.runner, self.cache, self.scheduler, self.seats = runner, cache, scheduler, seats
        self.speaker, self.text = speaker, text

    def end_text(self, request: Request, reason: StopReason) -> None:
        """The Thinker is done with `request`: the rest of its text goes out, its seat is given back
        and so are its blocks (its KV kept for the session's next turn); speech may go on."""
        request.move(State.TEXT_DONE)
        request.text_done_at, request.stop_reason = time.perf_counter(), reason
        self.text.flush(request)
        if request.claim is not None:
            if request.written:  # what this request computed stays for the session's next turn
                self.cache.publish(request.claim, request.prompt, request.output_ids, request.written)
            elif request.prepared is not None:
                # A prefill begun and cut short (cancelled, failed) published nothing, and the logits of
                # the rows it wrote were never checked: no graph may read them, past the session's end.
                self.runner.kv.forget_rows(request.table, request.claim.start)
            self.cache.release(request.claim)
            request.claim = None
            self.scheduler.blocks_freed()
        if request.seat is not None:
            self.seats.give_back(request.seat)
            request.seat = None
        request.prepared = request.detokenizer = None  # tensors and state go now

    def finish(self, request: Request, reason: StopReason) -> None:
        """`request` ended as `reason` says: its last event (the reply, the speech's report) goes out."""
        if not request.text_done:
            self.end_text(request, reason)
        # The end-of-turn token that ended the text is not the reply's (it ends the text at once).
        ended_at_eos = request.stop_reason == "end_of_turn"
        reply_ids = request.output_ids[:-1] if ended_at_eos else request.output_ids
        speech = request.spoken.report(request.submitted_at) if request.spoken is not None else None
        self.end_speech(request)
        request.events.put(self.text.finished(request, reason, reply_ids, speech))
        request.move(State.DONE)

    def fail(self, request: Request, message: str) -> None:
        if not request.text_done:
            self.end_text(request, "cancelled")
        self.end_speech(request)
        request.events.put(Failed(message))
        request.move(State.DONE)

    def fail_poisoned(self, request: Request) -> None:
        """`request`'s logits were not numbers: it fails alone. Its KV would make whatever attends
        to it NaN, its session's next turn included: its blocks' rows are zeroed and the session's
        cache entry dropped. The encoder outputs of its media after the cached prefix are dropped
        too, so a fault in them is not kept (on disk, even) for the next prompt that holds them."""
        claim = request.claim
        self.runner.encoder.forget([m for m in request.prompt.media if m.start >= claim.start], request.principal)
        self.cache.discard(claim)
        request.claim = None
        self.scheduler.blocks_freed()
        self.fail(request, NOT_A_NUMBER)

    def end_speech(self, request: Request) -> None:
        """The Talker's blocks back, once: when the speech is done (its text may go on) or when the
        request ends, whichever comes first (`Speaker.end` gives them back once)."""
        if request.spoken is not None:
            self.speaker.end(request.spoken)
            request.spoken.done = True
