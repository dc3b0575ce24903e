"""Replies the engine is made to give, for tests of what the layers above it make of a reply (the demo
model's own replies are noise): a test-only logits processor on the engine's sampler. Each reply the
engine begins takes the next script of token ids, and each token it chooses for that reply is chosen
from logits in which only the script's next id is likely; everything else (the sampler, the reply's
text, the server, the clients) runs as it does for any reply. A reply whose script has run out (the
step queued past its end) is the model's own again."""

import contextlib
from collections import deque
from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from omni_local.engine.engine import Engine
from omni_local.engine.forward.sampling import SampleBatch
from omni_local.protocol.params import SamplingParams

UNLIKELY = -1e4  # finite, so the engine's check that the chosen logit is a number passes


@contextlib.contextmanager
def forced_replies(engine: Engine, tokenizer: PreTrainedTokenizerBase, *replies: str) -> Iterator[list[list[int]]]:
    """While open, the next replies `engine` begins are the texts `replies`, each its tokenizer's ids
    (control tokens such as `<|im_end|>` included); yields the prompt ids each forced reply began with."""
    scripts = deque(deque(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in replies)
    by_seat: dict[int, deque[int]] = {}
    prompts: list[list[int]] = []
    sampler = engine.sampler
    start, sample = sampler.start, sampler.sample

    def starting(seat: int, params: SamplingParams, seed: int, prompt_ids: torch.Tensor, *rest: int) -> None:
        by_seat.pop(seat, None)  # a script cut short (by max_tokens, say) is not the next reply's
        if scripts:
            by_seat[seat] = scripts.popleft()
            prompts.append(prompt_ids.tolist())
        start(seat, params, seed, prompt_ids, *rest)

    # In place, so the engine's own reading of the logits (the chosen one a number, log-probabilities)
    # sees the forced row; they are inference tensors, changed in inference mode only.
    @torch.inference_mode()
    def sampling(logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        for row, seat in enumerate(batch.seats.tolist()):
            if by_seat.get(seat):
                logits[row].fill_(UNLIKELY)[by_seat[seat].popleft()] = 0.0
        return sample(logits, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "start", starting)
        patch.setattr(sampler, "sample", sampling)
        yield prompts
    assert not scripts, f"{len(scripts)} forced replies were never begun"
