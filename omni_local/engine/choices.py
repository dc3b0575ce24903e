"""Tokens chosen on the device, on their way to the host: queued beside the forward that made their
logits, read a turn later (a decode step's) or once the turn's step is queued (a first token's), so
the host never waits for the device to choose them."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omni_local.engine.logprobs import RowLogprobs, StepLogprobs, step_logprobs
from omni_local.engine.memory.host_copies import Readback
from omni_local.engine.request import Request


@dataclass(frozen=True)
class Choices:
    """The chosen tokens with whether their logits were numbers (`chosen_and_finite`), and the
    log-probabilities of the rows that asked."""

    chosen: Readback
    logprobs: StepLogprobs | None = None

    @classmethod
    def queue(cls, requests: Sequence[Request], logits: torch.Tensor, tokens: torch.Tensor,
              suppressed: torch.Tensor) -> "Choices":
        """Copies to the host of `tokens` [B] chosen from `logits` [B, vocab] (a row a request, in
        order), queued; with the log-probabilities of the requests that ask, none queued if none does."""
        chosen = Readback(chosen_and_finite(tokens, logits))
        asking = [row for row, request in enumerate(requests) if request.params.logprobs is not None]
        if not asking:
            return cls(chosen)
        most = max(requests[row].params.logprobs for row in asking)
        return cls(chosen, step_logprobs(logits, tokens, asking, most, suppressed))

    def read(self) -> tuple[list[list[int]], dict[int, RowLogprobs]]:
        """The tokens and whether their logits were numbers; the log-probabilities by row."""
        return self.chosen.tolist(), self.logprobs.read() if self.logprobs is not None else {}


@dataclass(frozen=True)
class DecodeStep:
    """A decode step queued on the device and not read yet: its requests, and their next tokens."""

    requests: list[Request]
    chosen: Choices


def chosen_and_finite(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[2, B] on the device: the tokens [B] chosen from `logits` [B, vocab], and under each a 1 if
    its logit is a number, a 0 if it is a NaN or an infinity. The chosen one suffices, and reads B
    values, not B x vocab, each step: a hidden state that is not numbers makes every logit NaN, and
    argmax picks a NaN or a +inf wherever a row holds one."""
    return torch.stack([tokens, logits.gather(1, tokens[:, None]).squeeze(1).isfinite().long()])
