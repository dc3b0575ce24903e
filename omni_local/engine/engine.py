"""The engine: one worker thread owns the model; requests arrive from any thread, and another
thread builds their prompts (the chat template, the tokenizer, the media's digests) in the order
they come (inbox.py), so the worker never stops every decoding chat to build one.

Each turn of the loop is schedule, run, postprocess. The scheduler (scheduler.py) admits waiting
requests and plans the turn: the prefill parts (one chunk a turn while another reply decodes or
speaks) and the requests to decode. The engine runs the parts (several prompts' in one forward,
their tokens packed, where prefills run eagerly: the experts' weights are read once for all of
them), then one decode step of every request decoding (one batched forward when graphed), then
reads the first tokens of the prompts that turn finished (chosen on the device after their last
part, read once that step is queued, so the decoding replies do not wait for them), then makes one
frame of every spoken reply (their Talker steps one batched forward too), and streams
(reply_text.py). How a request ends, finished or failed, is endings.py's. A spoken reply gives its
seat and blocks back when its text ends and stays in the turns until its speech ends. A reply that
may call tools is spoken up to where a call opens: the Talker's text ends at that token as it ends
at the end of turn, while the Thinker writes the call on.

The host does not wait for a decode step it queues. A step's tokens are chosen on the device
(SeatSampler, one row per seat) and are the next step's input there; the host reads them one turn
late, after the next step is queued, so the device computes that step while the host streams the
tokens, checks for the end of each reply and publishes to the prefix cache. What must be read at
once still waits for everything queued before it, this turn's step included: a prefill's first
token, and a spoken reply's codes. A reply that ended at a token was computed one step more
meanwhile: that step's token is dropped, and the KV row it wrote is not counted (`Request.written`).
Max-new-tokens and the context's end are known in advance: no step is queued past them.

On a GPU the engine serves once its decode steps' graphs are captured (`warm_up_later`); the
prefill graphs follow one at a time while it is idle, a prompt meanwhile computed eagerly, and
`warm` is set when none is left.

A prompt's rows are published to the prefix cache once its last row is computed and its logits
checked: a prefill cut short (cancelled, failed) leaves its session's entry as it found it.

Logits that are not numbers (a NaN or an infinity: a corrupt input, the model overflowing) come
from KV that would make every output attending to it NaN too. Whether each row of logits is all
numbers is computed on the device beside its token and read with it, so the check costs no wait;
a request whose logits are not all numbers fails alone, and its KV is scrubbed
(`PrefixCache.discard`).

A request that asks for log-probabilities gets them from the logits its token was chosen from,
computed beside the token and read with it (logprobs.py); a step in which none asks computes none.
"""

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from omni_local.access import LOCAL_USER
from omni_local.engine.choices import Choices, DecodeStep
from omni_local.engine.endings import Endings
from omni_local.engine.forward.prefill_chunks import PreparedPrompt
from omni_local.engine.forward.sampling import SeatSampler
from omni_local.engine.inbox import Inbox
from omni_local.engine.logprobs import RowLogprobs
from omni_local.engine.memory.kv_store import BlockTable
from omni_local.engine.parts import current_device, make_parts
from omni_local.engine.phases import (BEGIN_SPEECH, CHOOSE_FIRST, COLLECT, DECODE, FIRST_TOKEN, PREFILL, PREPARE,
                                      SPEECH_FRAME, phase)
from omni_local.engine.reply_text import ReplyText
from omni_local.engine.request import Request, State
from omni_local.engine.scheduler import Part, Scheduler
from omni_local.engine.seats import Seats
from omni_local.engine.warm_up import PrefillGraphsWarmUp
from omni_local.errors import OmniLocalError, RequestError
from omni_local.model.loader import LoadedModel, call_open_token_id, media_markup_token_ids, thinker_eos_token_ids
from omni_local.model.reasoning import reasoning_marks
from omni_local.protocol.events import AudioChunk, Waiting
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.settings import EngineConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, loaded: LoadedModel, settings: EngineConfig, max_prompt_tokens: int, warm_up_later: bool = False,
                 when_warm: Callable[["Engine"], None] = lambda engine: None) -> None:
        """`max_prompt_tokens`: the [limits] setting, past which a chat's earliest turns are left out.
        `warm_up_later`: serve before the prefill graphs are captured (by the worker, while idle);
        `when_warm` runs once every graph is, on the thread that captured the last."""
        self.loaded = loaded
        self.settings = settings
        parts = make_parts(loaded, settings, warm_up_later)
        self.encoder_cache, self.runner, self.speaker, self.cache = (parts.encoder_cache, parts.runner, parts.speaker,
                                                                     parts.cache)
        self.eos_ids = set(thinker_eos_token_ids(loaded))
        self.call_open = call_open_token_id(loaded)
        # A reply is text: a media placeholder in it would be taken for a medium in the next prompt.
        self.suppressed_ids = media_markup_token_ids(loaded)
        suppressed = torch.tensor(self.suppressed_ids, dtype=torch.long, device=self.runner.device)
        # Only a Thinking checkpoint's replies are split into reasoning and answer.
        self.reasoning_marks = reasoning_marks(loaded.processor.tokenizer) if loaded.kind == "thinking" else None
        self.text = ReplyText(loaded.processor.tokenizer, self.reasoning_marks, settings.max_context_tokens,
                              max_prompt_tokens)
        self.seats = Seats(settings.max_running_requests)
        vocab = loaded.model.thinker.lm_head.out_features
        self.sampler = SeatSampler(self.seats.count, vocab, self.runner.device, suppressed,
                                   self.reasoning_marks.end if self.reasoning_marks else None)
        self._inbox = Inbox(loaded.processor, max_prompt_tokens, self.reasoning_marks)
        self.scheduler = Scheduler(settings, self.cache, self.seats, self.runner.kv.shape.block_tokens)
        self._in_flight: DecodeStep | None = None  # the last decode step, read in the next turn
        # First tokens chosen this turn, read once the turn's decode step is queued (`_read_first_tokens`)
        self._first_choices: list[tuple[Request, Choices]] = []
        self.endings = Endings(self.runner, self.cache, self.scheduler, self.seats, self.speaker, self.text)
        self._graph_captures = PrefillGraphsWarmUp(self.runner, lambda: when_warm(self))
        self.warm = self._graph_captures.warm  # every graph captured
        self._worker = threading.Thread(target=self._loop, name="omni-engine", daemon=True)
        self._worker.start()

    def submit(
        self, session: str, messages: list[Message], params: SamplingParams, speech: SpeechParams | None = None,
        principal: str = LOCAL_USER, calls: bool = False
    ) -> Request:
        """Queue a reply to `messages` (ending in a user turn) in `principal`'s chat `session`, whose KV
        it continues; spoken too if `speech` is given, and then, if it may make tool `calls`, spoken up
        to its first call's opening. A request for speech this engine cannot make raises here."""
        if speech is not None:
            if self.speaker is None:
                raise RequestError("spoken replies need the Talker: start with speech = true (--speech true) "
                                   "on a checkpoint that has one")
            self.speaker.check(speech)
            if calls and self.call_open is None:
                raise RequestError("tools: this checkpoint's tokenizer has no single <tool_call> token, so a "
                                   "spoken reply could not stop before its calls: ask for text alone")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(session=session, messages=list(messages), params=params, seed=seed, speech=speech,
                          call_open=self.call_open if calls else None, principal=principal)
        self._inbox.put(request)
        return request

    def close(self) -> None:
        self._inbox.close()
        self._worker.join(timeout=30)
        if self.encoder_cache is not None:
            self.encoder_cache.close()  # the connection opened here, at start-up

    # The worker thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        # Events and streams are made on the thread's current device: the model's, not cuda:0's.
        with current_device(self.runner.device):
            self._serve()

    @property
    def busy(self) -> bool:
        """A request waits for a turn or is in one, or a decode step is in flight."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight)

    @property
    def queued(self) -> int:
        """Requests with their prompts built that the worker has yet to take in."""
        return self._inbox.queued

    def _serve(self) -> None:
        while True:
            idle, warm = not self.busy, self.warm.is_set()
            if idle:
                self.cache.make_room()  # while nobody waits, so the next request need not
            if not self._take_inbox(block=idle and warm):
                self._shut_down()
                return
            if idle and not self.scheduler.waiting and not warm:
                self._graph_captures.capture_one()  # one at a time: a request that comes waits for one capture at most
                continue
            self.cache.settle()  # the blocks of moves to host memory that have run, back to the pool
            self._admit()
            if self.scheduler.running or self._in_flight:
                self._guarded_turn()

    def _shut_down(self) -> None:
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.endings.fail(request, "the engine was closed")
        if self.encoder_cache is not None:
            self.encoder_cache.close()  # the worker's own database connection

    def _take_inbox(self, block: bool) -> bool:
        """Move new requests to the waiting line; False once the engine is closing."""
        requests, open_ = self._inbox.take(block)
        self.scheduler.waiting.extend(requests)
        return open_

    def _admit(self) -> None:
        """Admit what the scheduler can; finish or fail those it took out of the line; tell those left
        in line whose place changed where they are now (a pass over the line a turn, none a token)."""
        admission = self.scheduler.admit()
        for request in admission.cancelled:
            self.endings.finish(request, "cancelled")
        for request, error in admission.failed:
            self.endings.fail(request, self._failure_message(error))
        for request in self.scheduler.moved_in_line():
            request.events.put(Waiting(request.ahead))

    def _run_turn(self) -> None:
        """Prefills (the oldest waiting prompt's next part, and the short prompts after it that fit in
        the turn's budget); one decode step of the requests decoding, queued before the step of the
        turn before is read; one frame of each spoken reply."""
        plan = self.scheduler.plan()
        for request in plan.cancelled:
            self.endings.finish(request, "cancelled")
        if plan.prefills:
            self._prefill(plan.prefills)
        decoding = self.scheduler.make_room(plan.decoding, self._drain)
        previous, self._in_flight = self._in_flight, self._launch(decoding)
        if previous is not None:
            self._collect(previous)
        self._read_first_tokens()
        running = self.scheduler.running
        speaking = [r for r in running if r.speaking]
        if speaking:
            self._speak(speaking)
        for request in running:
            if request.state is State.TEXT_DONE and not request.speaking:
                self.endings.finish(request, request.stop_reason)

    def _guarded_turn(self) -> None:
        """A turn; where something raises past the guards of its parts (a fault of ours), the running
        requests fail with its message and the worker goes on serving: were the worker to die, every
        request, those to come included, would wait forever."""
        self._guarded(list(self.scheduler.running), self._run_turn)
        # A turn cut short may leave first tokens chosen and unread: those of the requests it failed go.
        self._first_choices = [(request, choice) for request, choice in self._first_choices if not request.ended]
        self.scheduler.drop_ended()

    def _drain(self) -> None:
        """Read the decode step in flight now, not in the next turn."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._collect(previous)

    def _guarded(self, requests: list[Request], work: Callable[[], T]) -> T | None:
        """What `work` for `requests` returns; if it raises, they fail with its message, the engine goes
        on serving the others, and this returns None."""
        try:
            return work()
        except Exception as error:  # noqa: BLE001 - the engine must keep serving the other requests
            message = self._failure_message(error)
            for request in requests:
                if not request.ended:
                    self.endings.fail(request, message)
            return None

    def _failure_message(self, error: Exception) -> str:
        if isinstance(error, OmniLocalError):
            return str(error)
        if isinstance(error, torch.OutOfMemoryError):
            self.runner.give_back_reserved(error)
            return "out of memory: try a shorter conversation, a smaller image or clip"
        log.error("request failed", exc_info=error)  # as it may be read after its `except`
        return f"internal error: {type(error).__name__}: {error}"

    def _prefill(self, parts: tuple[Part, ...]) -> None:
        """The turn's prefill parts (one forward where the runner packs them). Each prompt's first part
        prepares its whole tail (embeddings, media encoded) alone, so a bad medium fails its request
        only, as does a part's own failed forward; after a prompt's last part comes its first token."""
        ready = [part for part in parts if self._guarded([part.request], lambda: self._prepare(part.request))]
        with phase(PREFILL):
            results = self.runner.prefill_parts([self._rows(part) for part in ready])
        for part, result in zip(ready, results):
            if isinstance(result, Exception):
                self.endings.fail(part.request, self._failure_message(result))
            else:
                self._guarded([part.request], lambda: self._prefilled(part, result))

    def _prepare(self, request: Request) -> bool:
        if request.prepared is None:
            with phase(PREPARE):
                request.prepared = self.runner.prepare(request.prompt, request.claim.start, request.principal)
            request.media = request.prepared.media
        return True

    def _rows(self, part: Part) -> tuple[BlockTable, PreparedPrompt]:
        """Where `part` goes, and its rows of its prompt's prepared tail."""
        request = part.request
        return request.table, request.prepared.rows(request.prefilled, part.end)

    def _prefilled(self, part: Part, logits: torch.Tensor) -> None:
        """`part` is computed, its last row's `logits` [vocab] given: its first token is chosen if it
        was its prompt's last."""
        request = part.request
        request.advance_prefill(part.end)
        if request.state is State.DECODING:
            with phase(CHOOSE_FIRST):
                self._choose_first_token(request, logits)

    def _choose_first_token(self, request: Request, logits: torch.Tensor) -> None:
        """Queue the choice of the reply's first token from the prompt's last logits. It is read in
        this turn still, but after the other replies' decode step is queued and the one before read:
        read here, it would hold their next tokens back by this prompt's last part too, and the
        host's work on the first token (publishing the prompt's rows) would come in between."""
        prompt = request.prompt
        room = self.settings.max_context_tokens - prompt.num_tokens
        request.max_new_tokens = min(request.params.max_new_tokens, room)
        reasoning_limit = self.text.start(request)
        self.sampler.start(request.seat, request.params, request.seed, prompt.input_ids[0], reasoning_limit)
        tokens = self.sampler.sample(logits[None], self.sampler.batch([request.seat], [0]))
        self._first_choices.append((request, Choices.queue([request], logits[None], tokens, self.sampler.suppressed)))
        request.launched = 1

    def _read_first_tokens(self) -> None:
        """The first tokens chosen this turn, each read (speech starts from it, and it ends the time to
        first token) and taken; the prompts' rows published."""
        choices, self._first_choices = self._first_choices, []
        for request, choice in choices:
            with phase(FIRST_TOKEN):
                self._guarded([request], lambda: self._first_token(request, choice))

    def _first_token(self, request: Request, choice: Choices) -> None:
        ((token,), (finite,)), logprobs = choice.read()
        prompt = request.prompt
        if not finite:
            return self.endings.fail_poisoned(request)  # before its rows are published: nobody may read them
        request.written = prompt.num_tokens
        self.cache.publish(request.claim, prompt, [], request.written)
        if request.cancelled.is_set():
            self.endings.finish(request, "cancelled")  # the first token, which the cancel overtook, is dropped
        else:
            self._accept(request, token, logprobs.get(0))

    def _launch(self, requests: list[Request]) -> DecodeStep | None:
        """Queue one decode step of the `requests` whose next token is within their limits. A failure
        of the forward fails them all."""
        requests = [r for r in requests if r.launched < r.max_new_tokens]
        if not requests:
            return None
        with phase(DECODE):
            return self._guarded(requests, lambda: self._decode(requests))

    def _decode(self, requests: list[Request]) -> DecodeStep:
        """One token more of each request, queued on the device (one forward for them all when
        graphed): its last token in, as the device holds it; its next token out, read in the next
        turn by `_collect`. Nothing here waits for the device."""
        seats = [r.seat for r in requests]
        batch = self.sampler.batch(seats, [r.launched for r in requests])  # each token's index in its reply
        # Reply token `launched - 1`, the input, goes to row `prompt + launched - 1` of its sequence.
        indices = [r.prompt.num_tokens + r.launched - 1 for r in requests]
        logits = self.runner.decode([r.table for r in requests], self.sampler.inputs(batch), indices,
                                    [r.prepared.rope_delta for r in requests])
        tokens = self.sampler.sample(logits, batch)
        step = DecodeStep(requests, Choices.queue(requests, logits, tokens, self.sampler.suppressed))
        for request in requests:
            request.launched += 1
        return step

    def _collect(self, step: DecodeStep) -> None:
        """Accept the tokens of the step queued in the turn before (the device computes this turn's
        meanwhile). A request that ended since (at its previous token, cancelled, failed) drops its
        token: the step was one too many for it, and the KV row it wrote is not counted. A failure
        fails the step's requests; one of a request's own token (its logits not numbers, say), that
        request only."""
        with phase(COLLECT):
            (tokens, finite), logprobs = self._guarded(step.requests, step.chosen.read) or (([], []), {})
        for row, (request, token, numbers) in enumerate(zip(step.requests, tokens, finite)):
            if request.text_done:
                continue
            if not numbers:
                self.endings.fail_poisoned(request)
                continue
            request.written += 1  # the row of the token the step read
            if request.cancelled.is_set():
                self.endings.finish(request, "cancelled")  # the token of the step the cancel overtook is dropped
            else:
                self._guarded([request], lambda: self._accept(request, token, logprobs.get(row)))

    def _accept(self, request: Request, token: int, found: RowLogprobs | None = None) -> None:
        """Take `token` as `request`'s next; `found`: its log-probabilities, if the request asked."""
        opens_call = token == request.call_open
        if not request.output_ids:
            request.first_token_at = time.perf_counter()
            if request.speech is not None and token not in self.eos_ids and not opens_call:
                # Now, while the Thinker's blocks (and the Talker rows in them) are surely still held.
                with phase(BEGIN_SPEECH):
                    request.spoken = self.speaker.begin(request.speech, request.principal, request.session,
                                                        request.seed, request.prompt, token, self.runner.kv,
                                                        request.table)
        request.output_ids.append(token)
        if opens_call and request.call_opened is None:
            request.call_opened = len(request.output_ids) - 1
        if token in self.eos_ids:
            return self.endings.end_text(request, "end_of_turn")
        self.text.take(request, token, found)
        if len(request.output_ids) >= request.max_new_tokens:
            full = request.max_new_tokens == request.params.max_new_tokens
            self.endings.end_text(request, "max_new_tokens" if full else "context_full")

    def _speak(self, requests: list[Request]) -> None:
        """One frame more of each spoken reply: a first frame is its Talker prefill, alone (a failure
        fails its own reply); the later frames' Talker steps are one forward (a failure there fails
        them all, as a decode step's does); then each reply's audio (a failure, its own)."""
        with phase(SPEECH_FRAME):
            starting = [r for r in requests if not r.spoken.begun]
            going_on = [r for r in requests if r.spoken.begun]
            for request in starting:
                self._guarded([request], lambda: self.speaker.queue_first_frame(request.spoken))
            self._guarded(going_on, lambda: self.speaker.queue_frames([(r.spoken, *r.spoken_text) for r in going_on]))
            for request in requests:
                if not request.ended:
                    self._guarded([request], lambda: self._send_audio(request))

    def _send_audio(self, request: Request) -> None:
        chunk = self.speaker.frame_out(request.spoken)
        if chunk is not None:
            request.events.put(AudioChunk(*chunk))
        if request.spoken.done:
            # The Talker's blocks go back now, not when the text ends: the text may go on long after
            # (a tool call written after the spoken words, speech cut at max_speech_seconds), and
            # another spoken reply may wait for those blocks meanwhile.
            self.endings.end_speech(request)
