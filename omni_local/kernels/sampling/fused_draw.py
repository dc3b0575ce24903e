"""A whole draw of engine/forward/sampling.py's rule for a small vocabulary, one Triton program a row, on a
GPU.

A spoken reply draws 16 codes a frame (the Talker's first, then the code predictor's 15 in one
graph), each from a vocabulary of a few thousand. As sampling.py's tensor ops a draw is about 35
launches (penalties, temperature, the sort, softmax and cumsum of top-k and top-p, a scatter back,
the noise, two argmaxes, the seen and last writes), each a few µs in a replayed graph for a few KB
of work. Here one program holds its row's whole vocabulary in registers and does them all.

The rule is the tensor ops' (SeatSampler.sample): the penalty, the temperature, the suppressed ids,
the greedy choice, the uniform numbers and hence the Gumbel noise's inputs are the same bits (exact
divisions, the same hash). Two things can round apart from them, and only at the edge of top-p's
cut: the softmax's and the running sum's additions, whose order differs; and a token tied in value
with the last one kept, which stays here (the cut is a value), where the tensor ops' sort order
decides. The logarithms of the noise are Triton's, which may differ from torch's in the last bit.
"""

import torch
import triton
import triton.language as tl

from omni_local.kernels.sampling.uniform_noise import hashed_uniform

MOST_VOCAB = 8192  # the largest vocabulary one program holds (the Talker's is 3,072, its code predictor's 2,048)


# A frame's keys are slices of one tensor, at any offset: one compile serves them all (a vocabulary
# and sampling's flags each compile their own, at start-up: engine/forward/talker.py's warm-up).
@triton.jit(do_not_specialize=["vocab", "logits_stride"], do_not_specialize_on_alignment=["keys_ptr", "seats_ptr"])
def _draw_kernel(logits_ptr, seats_ptr, keys_ptr, temperature_ptr, top_k_ptr, top_p_ptr, penalty_ptr, seen_ptr,
                 suppressed_ptr, token_keys_ptr, last_ptr, tokens_ptr, vocab, logits_stride,
                 SAMPLING: tl.constexpr, SUPPRESSED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seat = tl.load(seats_ptr + row)
    ids = tl.arange(0, BLOCK)
    inside = ids < vocab
    seen_row = seen_ptr + seat * vocab
    logits = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + ids, mask=inside, other=float("-inf"))
    # the CTRL rule: shrink the scores of tokens already present (a penalty of 1 changes nothing)
    penalty = tl.load(penalty_ptr + seat)
    seen = tl.load(seen_row + ids, mask=inside, other=0) != 0
    scores = tl.where(seen, tl.where(logits < 0, logits * penalty, tl.div_rn(logits, penalty)), logits)
    temperature = tl.load(temperature_ptr + seat)
    if SAMPLING:  # a greedy row's scores stay as they are (over 1)
        scores = tl.div_rn(scores, tl.where(temperature > 0, temperature, 1.0))
    if SUPPRESSED:  # after all arithmetic, so a suppressed id's -inf stays -inf
        suppressed = tl.load(suppressed_ptr + ids, mask=inside, other=0) != 0
        scores = tl.where(suppressed, float("-inf"), scores)
    token = tl.argmax(scores, axis=0, tie_break_left=True)
    if SAMPLING:
        token_keys = tl.load(token_keys_ptr + ids, mask=inside, other=0).to(tl.uint32)
        noise = -tl.log(-tl.log(hashed_uniform(token_keys, tl.load(keys_ptr + row).to(tl.uint32))))
        cut = _kept_from(scores, ids, vocab, tl.load(top_k_ptr + seat), tl.load(top_p_ptr + seat))
        drawn = tl.argmax(tl.where(scores >= cut, scores, float("-inf")) + noise, axis=0, tie_break_left=True)
        token = tl.where(temperature > 0, drawn, token)
    tl.store(tokens_ptr + row, token)
    tl.store(last_ptr + seat, token)
    tl.store(seen_row + token, 1)


@triton.jit
def _kept_from(scores, ids, vocab, top_k, top_p):
    """The lowest score a draw keeps: within the top_k best (ties with the k-th stay; 0: all), then
    the best ones up to where the mass before a token reaches top_p (the best always stays)."""
    ordered = tl.sort(scores, descending=True)
    k = tl.where(top_k > 0, top_k, vocab)
    kth = tl.max(tl.where(ids == k - 1, ordered, float("-inf")), axis=0)
    ordered = tl.where(ordered < kth, float("-inf"), ordered)
    exps = tl.exp(ordered - tl.max(ordered, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    tail = tl.cumsum(probs, axis=0) - probs >= tl.where(top_p < 1, top_p, float("inf"))  # 1: no cut
    kept = tl.where(tail, float("-inf"), ordered)
    return tl.min(tl.where(kept > float("-inf"), kept, float("inf")), axis=0)


def fused_draw(logits: torch.Tensor, seats: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor,
               suppressed: torch.Tensor | None, token_keys: torch.Tensor, last: torch.Tensor,
               sampling: bool) -> torch.Tensor:
    """The tokens [B] chosen from `logits` [B, vocab] float32 for the seats `seats` [B] by their rows
    of the table (`temperature` ... `seen` [seats, vocab] bool, as SamplingRows holds them) with the
    random keys `keys` [B]; `suppressed`: a [vocab] bool mask of ids never chosen, or None. Each
    chosen token is marked in `seen` and kept in `last`, as SeatSampler.sample does."""
    rows, vocab = logits.shape
    assert vocab <= MOST_VOCAB and seen.shape[1] == vocab and logits.stride(1) == 1, (logits.shape, seen.shape)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    flags = seen.view(torch.uint8)
    _draw_kernel[(rows,)](logits, seats, keys, temperature, top_k, top_p, penalty, flags,
                          flags if suppressed is None else suppressed.view(torch.uint8), token_keys, last, tokens,
                          vocab, logits.stride(0), SAMPLING=sampling, SUPPRESSED=suppressed is not None, BLOCK=block,
                          num_warps=4 if block <= 2048 else 8)
    return tokens
