"""The sampler's filters agree with transformers' own logits processors."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from omni_local.engine.sampling import Sampler, SamplingParams, _nucleus, _penalize_repeats, next_tokens
from omni_local.errors import RequestError


def logits(seed: int = 0, vocab: int = 300) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_repetition_penalty_matches_transformers():
    seen = torch.tensor([3, 17, 17, 250])
    ours = _penalize_repeats(logits(), seen, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits()[None])[0]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9])
def test_nucleus_filtering_keeps_the_same_tokens_as_transformers(top_p):
    ours = torch.isfinite(_nucleus(logits(1), top_p))
    theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits(1)[None])[0])
    assert torch.equal(ours, theirs)


def test_top_k_sampling_only_ever_picks_among_the_k_best():
    scores = logits(2)
    best = set(torch.topk(scores, 5).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=5), seed=0, prompt_ids=torch.tensor([1]))
    picks = {sampler.next_token(scores) for _ in range(200)}
    assert picks <= best and len(picks) > 1
    assert torch.isfinite(TopKLogitsWarper(5)(None, scores[None])[0]).sum() == 5


def test_greedy_picks_the_best_token_after_the_penalty():
    scores = torch.tensor([1.0, 5.0, 4.9])
    penalised = Sampler(SamplingParams(repetition_penalty=1.5), seed=0, prompt_ids=torch.tensor([1]))
    assert penalised.next_token(scores) == 2  # 5.0 / 1.5 falls below 4.9
    assert Sampler(SamplingParams(), seed=0, prompt_ids=torch.tensor([1])).next_token(scores) == 1


def test_the_penalty_also_covers_tokens_the_reply_already_produced():
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), seed=0, prompt_ids=torch.tensor([0]))
    scores = torch.tensor([0.0, 3.0, 2.0])
    assert [sampler.next_token(scores), sampler.next_token(scores)] == [1, 2]


@pytest.mark.parametrize(
    ("values", "message"),
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
     ({"repetition_penalty": 0}, "repetition_penalty")],
)
def test_invalid_sampling_values_are_refused_with_their_name(values, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**values)


def test_suppressed_tokens_are_never_chosen_even_when_they_score_best():
    scores = torch.tensor([0.0, 9.0, 1.0, 8.0])
    suppressed = torch.tensor([1, 3])
    greedy = Sampler(SamplingParams(), seed=0, prompt_ids=torch.tensor([0]), suppressed=suppressed)
    assert greedy.next_token(scores) == 2
    sampled = Sampler(SamplingParams(temperature=5.0), seed=0, prompt_ids=torch.tensor([0]), suppressed=suppressed)
    assert {sampled.next_token(scores) for _ in range(100)} <= {0, 2}


def test_the_tokens_of_a_batch_are_the_tokens_each_sampler_picks_alone():
    rows = torch.stack([logits(seed) for seed in range(5)])
    rows[3, [7, 9]] = rows[3].max() + 1  # a tie: the first of the best, as argmax gives it
    suppressed = torch.tensor([int(rows[0].argmax()), 5])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(),
              SamplingParams(repetition_penalty=1.3)]

    def samplers() -> list[Sampler]:
        return [Sampler(p, seed=i, prompt_ids=torch.tensor([0, 7]), suppressed=suppressed) for i, p in enumerate(params)]

    alone = [sampler.next_token(row) for sampler, row in zip(samplers(), rows)]
    assert next_tokens(samplers(), rows) == alone
    assert alone[3] == 7
