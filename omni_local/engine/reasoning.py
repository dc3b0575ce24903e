"""A Thinking reply's reasoning, told apart from its answer as the host reads its tokens.

The reasoning is the reply's tokens up to `</think>`: from its start where the prompt opened the
block (Qwen's Thinking template does), or from a `<think>` the reply starts with. The markers are
in neither text; every token stays in the reply's ids, so the prefix cache keeps the turn as made.
Where a reasoning limit is set, the sampler ends the block on the device (SeatSampler).
"""

import numpy as np

from omni_local.engine.detokenizer import IncrementalDetokenizer
from omni_local.model.reasoning import ReasoningMarks


class ReasoningText:
    def __init__(self, marks: ReasoningMarks, opened: bool, tokenizer: object) -> None:
        self.marks = marks
        self.inside = opened  # the tokens now read are reasoning
        self.may_open = not opened  # only a reply's first token can open the block
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.streamed = ""  # the reasoning sent as deltas so far

    def take(self, token: int) -> str | None:
        """The reasoning text `token` adds ("" for a marker, or a character not complete yet), or
        None if it is the answer's."""
        opens, self.may_open = self.may_open and token == self.marks.start, False
        if opens:
            self.inside = True
            return ""
        if not self.inside:
            return None
        if token == self.marks.end:
            self.inside = False
            return self.rest()
        return self._sent(self.detokenizer.push(token))

    def rest(self) -> str:
        """What the detokenizer still holds (an unfinished character), once no more reasoning comes."""
        full = self.detokenizer.text()
        return self._sent(full[len(self.streamed):] if full.startswith(self.streamed) else "")

    def _sent(self, delta: str) -> str:
        self.streamed += delta
        return delta


def prompt_opens_reasoning(prompt_ids: np.ndarray, marks: ReasoningMarks) -> bool:
    """Whether the prompt ends inside a reasoning block: its last `<think>` has no `</think>` after it.
    (Typed text never holds the markers' ids: prompt/builder.py encodes it as plain text.)"""
    starts, ends = np.flatnonzero(prompt_ids == marks.start), np.flatnonzero(prompt_ids == marks.end)
    return starts.size > 0 and (ends.size == 0 or starts[-1] > ends[-1])
