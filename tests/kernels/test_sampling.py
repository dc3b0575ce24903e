"""The sampler chooses a whole batch's tokens on the device: greedy rows as argmax, sampled rows from
their own filtered distribution with their own random numbers, its filters as transformers' own."""

import json
import math
import re

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from device_under_test import TEST_DEVICE
from omni_local.engine.forward.sampling import (
    Sampler, SamplingRows, SeatSampler, _filtered, _hash32, _penalize_repeats, _uniform, uniform_numbers,
)
from omni_local.errors import RequestError
from omni_local.protocol.params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300


def logits(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def started(params: list[SamplingParams], seeds: list[int] | None = None, prompt: tuple[int, ...] = (0,),
            suppressed: list[int] | None = None, vocab: int = VOCAB) -> SeatSampler:
    """A sampler with a seat per `params`, each started with its seed (its seat number by default)."""
    table = SeatSampler(len(params), vocab, CPU, torch.tensor(suppressed) if suppressed else None)
    for seat, p in enumerate(params):
        table.start(seat, p, seeds[seat] if seeds else seat, torch.tensor(prompt))
    return table


def draw(table: SeatSampler, rows: torch.Tensor, seats: list[int], draws: list[int]) -> list[int]:
    return table.sample(rows, table.batch(seats, draws)).tolist()


def one_row(vocab: int = VOCAB, top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0) -> SamplingRows:
    table = started([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)], vocab=vocab)
    return table.rows


def test_greedy_picks_what_argmax_picks_ties_to_the_first():
    rows = torch.stack([logits(seed) for seed in range(4)])
    rows[2, [7, 9]] = rows[2].max() + 1
    picks = draw(started([SamplingParams()] * 4), rows, [0, 1, 2, 3], [0] * 4)
    assert picks == rows.argmax(dim=-1).tolist() and picks[2] == 7


def test_greedy_rows_batched_with_sampled_rows_still_pick_argmax():
    rows = torch.stack([logits(seed) for seed in range(4)])
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=2.0)]
    picks = draw(started(params), rows, [0, 1, 2, 3], [0] * 4)
    assert [picks[0], picks[2]] == rows[[0, 2]].argmax(dim=-1).tolist()


def test_suppressed_tokens_are_never_chosen_even_when_they_score_best():
    scores = torch.tensor([[0.0, 9.0, 1.0, 8.0]])
    greedy = started([SamplingParams()], suppressed=[1, 3], vocab=4)
    assert draw(greedy, scores, [0], [0]) == [2]
    sampled = started([SamplingParams(temperature=5.0)], suppressed=[1, 3], vocab=4)
    assert {draw(sampled, scores, [0], [i])[0] for i in range(100)} == {0, 2}


@pytest.mark.parametrize(("temperature", "row", "value"),
                         [(1.0, "temperature", math.inf), (0.0, "penalty", 0.0), (1.0, "penalty", 0.0)])
def test_suppressed_tokens_stay_out_whatever_a_rows_parameters_do_to_the_scores(temperature, row, value):
    # Values SamplingParams refuses, set on the row itself: -inf / inf and -inf * 0 are NaN, which
    # argmax would pick, so the suppression must come after them and rest on no parameter's value.
    scores = torch.tensor([[0.0, 9.0, 1.0, 8.0]])
    table = started([SamplingParams(temperature=temperature)], prompt=(1, 3), suppressed=[1, 3], vocab=4)
    getattr(table.rows, row)[0] = value
    assert {draw(table, scores, [0], [i])[0] for i in range(50)} <= {0, 2}


def test_every_hash_gives_a_uniform_number_strictly_inside_0_and_1_so_the_noise_stays_finite():
    uniform = _uniform(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert ((uniform > 0) & (uniform < 1)).all() and torch.isfinite(-torch.log(-torch.log(uniform))).all()


def test_the_gpus_one_kernel_gives_the_uniform_numbers_of_the_tensor_ops_bit_for_bit():
    from omni_local.kernels.sampling.uniform_noise import BLOCK, kernel_uniform_numbers  # the interpreter on a CPU run

    vocab = BLOCK + 301  # a ragged last tile
    token_keys = _hash32(torch.arange(vocab, device=TEST_DEVICE))
    # 32-bit keys with the top bit set and not, in a slice at an odd offset (as a frame's are)
    keys = torch.tensor([7, 2**32 - 1, 2**31 + 12345, 0, 987654321], device=TEST_DEVICE)[1:]
    assert torch.equal(kernel_uniform_numbers(keys, token_keys), uniform_numbers(keys, token_keys))


def test_the_uniform_numbers_kernel_compiles_for_an_h200_without_a_gpu():
    from compile_for_h200 import compile_for_h200

    done = compile_for_h200("""
from omni_local.kernels.sampling.uniform_noise import BLOCK, _uniform_kernel
compiled(_uniform_kernel, dict(keys_ptr="*i64", token_keys_ptr="*i64", out_ptr="*fp32"), dict(BLOCK=BLOCK),
         aligned=("token_keys_ptr", "out_ptr"), num_warps=4)
""")

    assert done.returncode == 0, done.stderr


def fused_draws(table: SeatSampler, scores: torch.Tensor, seats: list[int], draw_index: int) -> list[int]:
    """kernels/sampling/fused_draw.py's kernel choosing for `seats` of `table` (a CPU table, its rows
    copied to TEST_DEVICE and back): its tokens, with the table's seen and last rows updated as the
    kernel left them."""
    from omni_local.kernels.sampling.fused_draw import fused_draw  # the interpreter on a CPU run

    batch = table.batch(seats, [draw_index] * len(seats))
    rows = [t.to(TEST_DEVICE) for t in (table.rows.temperature, table.rows.top_k, table.rows.top_p,
                                         table.rows.penalty, table.rows.seen)]
    suppressed = None
    if table.suppressed is not None:
        suppressed = torch.zeros(scores.shape[1], dtype=torch.bool).index_fill_(0, table.suppressed, True)
    last = table.last.to(TEST_DEVICE)
    tokens = fused_draw(scores.to(TEST_DEVICE), batch.seats.to(TEST_DEVICE), batch.keys.to(TEST_DEVICE), *rows,
                        None if suppressed is None else suppressed.to(TEST_DEVICE),
                        table._token_keys.to(TEST_DEVICE), last, batch.sampling)
    table.rows.seen.copy_(rows[-1].cpu())
    table.last.copy_(last.cpu())
    return tokens.tolist()


MIXED = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5, top_p=0.8, repetition_penalty=1.3),
         SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=1.0, top_k=3),
         SamplingParams(repetition_penalty=2.0)]


@pytest.mark.parametrize("sampled", [True, False])
def test_the_gpus_one_kernel_draw_chooses_what_the_tensor_ops_choose(sampled):
    params = MIXED if sampled else [p for p in MIXED if p.greedy]
    vocab, seats = 50, list(range(len(params)))[::-1]
    ours, reference = (started(params, prompt=(1, 2, 3, 7), suppressed=[5, 9], vocab=vocab) for _ in range(2))
    for index in range(4):
        scores = torch.stack([logits(10 * index + seat, vocab) for seat in seats])
        scores[0, [11, 17]] = scores[0].max() + 1  # a greedy tie: the first wins
        assert fused_draws(ours, scores, seats, index) == draw(reference, scores, seats, [index] * len(seats))
    assert torch.equal(ours.rows.seen, reference.rows.seen) and torch.equal(ours.last, reference.last)


def test_the_one_kernel_draw_keeps_top_ks_ties_and_never_picks_a_suppressed_token():
    table = started([SamplingParams(temperature=1.0, top_k=2)], suppressed=[0], vocab=6)
    scores = torch.tensor([[9.0, 4.0, 4.0, 4.0, 1.0, 0.0]])  # the 2nd best is tied three ways
    picks = {fused_draws(table, scores, [0], index)[0] for index in range(40)}
    assert picks == {1, 2, 3}


def test_the_one_kernel_draw_compiles_for_an_h200_without_a_gpu():
    from compile_for_h200 import compile_for_h200

    done = compile_for_h200("""
from omni_local.kernels.sampling.fused_draw import _draw_kernel
pointers = dict(logits_ptr="*fp32", seats_ptr="*i64", keys_ptr="*i64", temperature_ptr="*fp32", top_k_ptr="*i64",
                top_p_ptr="*fp32", penalty_ptr="*fp32", seen_ptr="*u8", suppressed_ptr="*u8", token_keys_ptr="*i64",
                last_ptr="*i64", tokens_ptr="*i64")
for block, warps in ((2048, 4), (4096, 8)):
    compiled(_draw_kernel, pointers, dict(SAMPLING=True, SUPPRESSED=True, BLOCK=block),
             aligned=("logits_ptr", "token_keys_ptr", "seen_ptr"), num_warps=warps)
""")

    assert done.returncode == 0, done.stderr


def test_filtered_out_tokens_are_never_drawn_in_many_draws():
    n, scores, temperature = 20_000, logits(3), 0.9
    table = started([SamplingParams(temperature=temperature, top_k=50, top_p=0.8)] * n,
                    suppressed=list(range(150, VOCAB)))
    picks = torch.tensor(draw(table, scores.expand(n, -1), list(range(n)), [0] * n))
    suppressed = (scores / temperature).index_fill(0, torch.arange(150, VOCAB), float("-inf"))
    kept = torch.isfinite(_filtered(suppressed[None], table.rows.select(torch.tensor([0]))))[0]
    assert kept[picks].all() and len(set(picks.tolist())) == kept.sum()


def test_top_k_keeps_the_tokens_transformers_keeps():
    scores = logits(2)
    ours = torch.isfinite(_filtered(scores[None], one_row(top_k=5)))[0]
    theirs = torch.isfinite(TopKLogitsWarper(5)(None, scores[None])[0])
    assert torch.equal(ours, theirs) and ours.sum() == 5


def test_top_k_keeps_every_token_tied_with_the_kth_best_as_transformers_does():
    scores = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0, 0.0])
    ours = torch.isfinite(_filtered(scores[None], one_row(vocab=6, top_k=2)))[0]
    theirs = torch.isfinite(TopKLogitsWarper(2)(None, scores[None])[0])
    assert torch.equal(ours, theirs) and ours.tolist() == [True, True, True, True, False, False]


def test_top_k_sampling_only_ever_picks_among_the_k_best():
    scores = logits(2)
    best = set(torch.topk(scores, 5).indices.tolist())
    table = started([SamplingParams(temperature=2.0, top_k=5)])
    picks = {draw(table, scores[None], [0], [i])[0] for i in range(200)}
    assert picks <= best and len(picks) > 1


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9])
def test_top_p_drops_the_tail_transformers_drops(top_p):
    ours = torch.isfinite(_filtered(logits(1)[None], one_row(top_p=top_p)))[0]
    theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits(1)[None])[0])
    assert torch.equal(ours, theirs) and ours.sum() < VOCAB


def test_the_repetition_penalty_follows_the_ctrl_rule_as_transformers_does():
    seen = torch.tensor([3, 17, 17, 250])
    mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    mask[0, seen] = True
    ours = _penalize_repeats(logits()[None], mask, torch.tensor([1.3]))[0]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits()[None])[0]
    assert torch.equal(ours, theirs)


def test_greedy_picks_the_best_token_after_the_penalty():
    scores = torch.tensor([[1.0, 5.0, 4.9]])
    assert draw(started([SamplingParams(repetition_penalty=1.5)], prompt=(1,), vocab=3), scores, [0], [0]) == [2]
    assert draw(started([SamplingParams()], prompt=(1,), vocab=3), scores, [0], [0]) == [1]


def test_the_penalty_also_covers_tokens_the_reply_already_produced():
    table = started([SamplingParams(repetition_penalty=2.0)], prompt=(0,), vocab=3)
    scores = torch.tensor([[0.0, 3.0, 2.0]])
    assert [draw(table, scores, [0], [0]), draw(table, scores, [0], [1])] == [[1], [2]]  # 3 / 2 falls below 2


def test_each_chosen_token_is_its_seats_next_decode_input():
    table = started([SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()])
    batch = table.batch([2, 0], [0, 0])
    chosen = table.sample(torch.stack([logits(1), logits(2)]), batch)
    assert torch.equal(table.inputs(batch), chosen)


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch_in_any_order_and_seat():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20), SamplingParams(),
              SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.2)]
    seeds = [11, 22, 33, 44]
    rows = torch.stack([logits(i) for i in range(4)])
    together = draw(started(params, seeds), rows, [0, 1, 2, 3], [5] * 4)
    backwards = draw(started(params, seeds), rows.flip(0), [3, 2, 1, 0], [5] * 4)
    alone = [draw(started([p], [seed]), rows[i : i + 1], [0], [5])[0] for i, (p, seed) in enumerate(zip(params, seeds))]
    assert together == alone == backwards[::-1]


def test_different_seeds_and_different_tokens_of_a_reply_draw_differently():
    flat = torch.zeros(1, VOCAB)
    by_seed = [draw(started([SamplingParams(temperature=1.0)], [seed]), flat, [0], [0])[0] for seed in range(20)]
    by_index = [draw(started([SamplingParams(temperature=1.0)], [7]), flat, [0], [i])[0] for i in range(20)]
    assert len(set(by_seed)) > 10 and len(set(by_index)) > 10


@pytest.mark.parametrize(("temperature", "share"), [(1.0, 0.75), (0.5, 0.9)])
def test_sampled_tokens_follow_the_distribution(temperature, share):
    # Two tokens at probabilities 1/4 and 3/4; temperature 1/2 squares them: 1/10 and 9/10.
    n = 4000
    table = started([SamplingParams(temperature=temperature)] * n, seeds=list(range(n)), vocab=2)
    rows = torch.tensor([[math.log(0.25), math.log(0.75)]]).expand(n, -1)
    picks = draw(table, rows, list(range(n)), list(range(n)))
    assert abs(sum(picks) / n - share) < 0.03  # 4 standard deviations at most


def test_the_one_row_sampler_draws_what_a_seat_with_its_seed_draws():
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.8, repetition_penalty=1.1)
    one = Sampler(params, 9, torch.tensor([0]))
    table = started([params], [9])
    rows = [logits(i) for i in range(6)]
    assert [int(one.next_token(row)) for row in rows] == [draw(table, row[None], [0], [i])[0] for i, row in enumerate(rows)]


def test_a_top_k_beyond_the_vocabulary_is_no_limit():
    huge = started([SamplingParams(temperature=1.0, top_k=10**30)])
    unlimited = started([SamplingParams(temperature=1.0)])
    rows = [logits(i) for i in range(10)]
    assert [draw(huge, row[None], [0], [i]) for i, row in enumerate(rows)] == \
        [draw(unlimited, row[None], [0], [i]) for i, row in enumerate(rows)]


@pytest.mark.parametrize(
    ("values", "message"),
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
     ({"repetition_penalty": 0}, "repetition_penalty"),
     # Finite numbers, but not as the device keeps them (float32): there they are infinite, or 0.
     ({"temperature": 1e39}, "temperature must be 0 (greedy) or a finite number of at least 0.001"),
     # Positive, but so small that the scores it divides overflow.
     ({"temperature": 1e-40}, "temperature must be 0 (greedy) or a finite number of at least 0.001"),
     ({"repetition_penalty": 1e-50}, "repetition_penalty must be a finite number above 0"),
     ({"top_p": 1e-50}, "top_p must be in (0, 1]"),
     ({"max_new_tokens": 4.0}, "max_new_tokens must be a whole number, not 4.0"),
     ({"temperature": [1]}, "temperature must be a number, not [1]")],
)
def test_invalid_sampling_values_are_refused_with_their_name(values, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        SamplingParams(**values)


def test_numpy_numbers_are_kept_as_plain_python_numbers_a_result_can_be_written_as_json():
    params = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.uint64(7))
    assert (params.max_new_tokens, params.temperature, params.seed) == (3, 0.5, 7)
    assert json.dumps([params.max_new_tokens, params.temperature, params.seed]) == "[3, 0.5, 7]"
