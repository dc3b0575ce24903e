"""A reply's text on its way out: each accepted token turned into answer or reasoning deltas (with
the log-probabilities the request asked for), what the detokenizers hold back sent once the text
ends, and the reply's `Finished` event. The engine decides when; this says what is streamed."""

from omni_local.engine.detokenizer import IncrementalDetokenizer
from omni_local.engine.logprobs import RowLogprobs, TokenTexts
from omni_local.engine.reasoning import ReasoningText, prompt_opens_reasoning
from omni_local.engine.request import Request
from omni_local.model.reasoning import ReasoningMarks
from omni_local.protocol.events import ContextUse, Finished, ReasoningDelta, SpeechReport, StopReason, TextDelta


class ReplyText:
    def __init__(self, tokenizer: object, reasoning_marks: ReasoningMarks | None, max_context_tokens: int,
                 max_prompt_tokens: int) -> None:
        """`reasoning_marks`: a Thinking checkpoint's, whose replies are split into reasoning and answer.
        The two limits are what each reply's `ContextUse` reports."""
        self.tokenizer, self.reasoning_marks = tokenizer, reasoning_marks
        self.max_context_tokens, self.max_prompt_tokens = max_context_tokens, max_prompt_tokens
        self.token_texts = TokenTexts(tokenizer)  # for the replies that ask for logprobs

    def start(self, request: Request) -> int:
        """Make the reply's detokenizers: its answer's, and its reasoning's on a Thinking checkpoint.
        Returns how many tokens it may reason for (0: no limit, or its prompt opened no reasoning)."""
        opened = False
        if self.reasoning_marks is not None:
            opened = prompt_opens_reasoning(request.prompt.input_ids[0].numpy(), self.reasoning_marks)
            request.reasoning = ReasoningText(self.reasoning_marks, opened, self.tokenizer)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, strip_leading=request.reasoning is not None)
        return request.params.max_reasoning_tokens if opened else 0

    def take(self, request: Request, token: int, found: RowLogprobs | None) -> None:
        """Stream what `token` (not an end of turn) adds; `found`: its log-probabilities, if asked for."""
        reasoned = request.reasoning.take(token) if request.reasoning is not None else None
        if reasoned is not None:
            _stream_reasoning(request, reasoned)  # reasoning is not the answer: no logprobs
            return
        if found is not None:
            request.unsent_logprobs.append(self.token_texts.logprob(token, found, request.params.logprobs))
        _stream(request, request.detokenizer.push(token))

    def flush(self, request: Request) -> None:
        """The text has ended: what the detokenizers held back goes out, and the unsent logprobs."""
        if request.reasoning is not None and request.reasoning.inside:  # it stopped while reasoning
            _stream_reasoning(request, request.reasoning.rest())
        if request.detokenizer is not None:  # what it held back (an unfinished character) goes out now
            full = request.detokenizer.text()
            if full.startswith(request.streamed):
                _stream(request, full[len(request.streamed):])
        if request.unsent_logprobs:  # of tokens that made no text (markup the text leaves out, say)
            request.events.put(TextDelta("", tuple(request.unsent_logprobs)))
            request.unsent_logprobs = []

    def finished(self, request: Request, reason: StopReason, reply_ids: list[int], speech: SpeechReport | None
                 ) -> Finished:
        """The reply's last event: its text and `reply_ids` (its tokens but the end of turn), counts, timings."""
        counts = request.counts(generated=len(reply_ids))
        context = ContextUse(self.max_context_tokens, self.max_prompt_tokens, request.turns_left_out)
        reasoning = request.reasoning.streamed if request.reasoning is not None else ""
        return Finished(request.streamed, reply_ids, reason, counts, request.timings(), request.seed, context, speech,
                        request.media, reasoning)


def _stream(request: Request, delta: str) -> None:
    if delta:
        request.streamed += delta
        request.events.put(TextDelta(delta, tuple(request.unsent_logprobs)))
        request.unsent_logprobs = []


def _stream_reasoning(request: Request, delta: str) -> None:
    if delta:
        request.events.put(ReasoningDelta(delta))
