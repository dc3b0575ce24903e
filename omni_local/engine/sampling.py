"""Choosing the next token from the logits: greedy, or sampled with a per-request seed."""

from dataclasses import dataclass

import torch

from omni_local.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a fresh random seed, reported in the result

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be 0 (greedy) or more"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (off) or more"),
            (self.repetition_penalty > 0, "repetition_penalty must be above 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's sampler: its own random stream, so a seed reproduces the reply."""

    def __init__(
        self, params: SamplingParams, seed: int, prompt_ids: torch.Tensor, suppressed: torch.Tensor | None = None
    ) -> None:
        self.params = params
        self.generator = torch.Generator(device=prompt_ids.device)
        self.generator.manual_seed(seed)
        self.suppressed = suppressed  # ids never chosen
        # The ids the repetition penalty looks at: the prompt's, then each reply token's.
        self.seen = prompt_ids if params.repetition_penalty != 1.0 else None

    @property
    def _plain_greedy(self) -> bool:
        """Greedy with no repetition penalty: a choice `next_tokens` makes for many rows at once."""
        return self.params.greedy and self.seen is None

    def next_token(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32, on the device of the prompt ids."""
        token = self._choose(logits)
        if self.seen is not None:
            self.seen = torch.cat([self.seen, self.seen.new_tensor([token])])
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if self.suppressed is not None:
            logits = logits.index_fill(0, self.suppressed, float("-inf"))
        if self.seen is not None:
            logits = _penalize_repeats(logits, self.seen, p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            logits = _nucleus(logits, p.top_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def next_tokens(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """Each sampler's next token from its row of `logits` [B, vocab]. The plain greedy ones (the
    default) that share their suppressed ids are chosen with one argmax and one copy to the host for
    them all, instead of one wait for the device each; the others one by one."""
    plain = [i for i, s in enumerate(samplers) if s._plain_greedy]
    suppressed = samplers[plain[0]].suppressed if plain else None
    together = [i for i in plain if samplers[i].suppressed is suppressed]
    chosen: dict[int, int] = {}
    if together:
        rows = logits[together]
        if suppressed is not None:
            rows = rows.index_fill(1, suppressed, float("-inf"))
        chosen = dict(zip(together, rows.argmax(dim=-1).tolist()))
    return [chosen[i] if i in chosen else s.next_token(row) for i, (s, row) in enumerate(zip(samplers, logits))]


def _penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    # The CTRL rule, as transformers applies it: shrink the scores of tokens already present.
    scores = logits.gather(0, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token once the mass before it already reaches top_p; the first token always stays.
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter(0, order, sorted_logits)
