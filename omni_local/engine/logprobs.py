"""Log-probabilities of reply tokens, for the requests that ask (`SamplingParams.logprobs`).

They are the model's distribution: the log-softmax of a step's logits over the ids a reply may hold
(the media markup the sampler never chooses left out), before the repetition penalty, the
temperature, top-k and top-p shape the draw, as OpenAI reports its models'. They are computed on the
device from the logits the sampler drew from (a graphed step's too), for the asking rows only, and
read with the step's tokens; a step in which nobody asks computes nothing here.
"""

from dataclasses import dataclass

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from omni_local.engine.memory.host_copies import Readback, to_device
from omni_local.protocol.events import TokenChoice, TokenLogprob

# Of a row: its chosen token's log-probability, and the (id, log-probability) of the best ones.
RowLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class StepLogprobs:
    """The log-probabilities of the asking rows of one sampling, on their way to the host."""

    rows: list[int]  # the rows that asked, of the sampled batch
    values: Readback  # [R, 1 + k] float32: the chosen token's, then the k best, best first
    ids: Readback  # [R, k] long: the k best ids

    def read(self) -> dict[int, RowLogprobs]:
        """Per asking row of the batch: its chosen token's log-probability, and the k best."""
        values, ids = self.values.tolist(), self.ids.tolist()
        return {row: (lps[0], list(zip(best, lps[1:]))) for row, lps, best in zip(self.rows, values, ids)}


@torch.inference_mode()
def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int,
                  suppressed: torch.Tensor | None) -> StepLogprobs:
    """Queue the log-probabilities of the tokens [B] chosen from `logits` [B, vocab] (on the device),
    and the `k` best, for the batch's `rows`; read them with `StepLogprobs.read`."""
    at = to_device(torch.tensor(rows), logits.device)
    scores = logits.index_select(0, at).float()
    if suppressed is not None:
        scores = scores.index_fill(1, suppressed, float("-inf"))
    logprobs = scores.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, at)[:, None])
    best, best_ids = logprobs.topk(k, dim=-1)  # sorted, best first
    return StepLogprobs(rows, Readback(torch.cat([chosen, best], dim=1)), Readback(best_ids))


class TokenTexts:
    """Each token's text and bytes, as OpenAI's logprobs give them, from a byte-level BPE tokenizer
    (Qwen's): a vocabulary entry's characters stand for bytes (GPT-2's table), an added token (the
    chat markup) is its own text. Made once an id."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._added = {token_id: added.content for token_id, added in tokenizer.added_tokens_decoder.items()}
        self._known: dict[int, tuple[str, bytes | None]] = {}

    def logprob(self, token_id: int, found: RowLogprobs, k: int) -> TokenLogprob:
        """The entry of reply token `token_id` with its row's log-probabilities, `k` alternatives."""
        chosen, best = found
        text, utf8 = self._text(token_id)
        return TokenLogprob(text, chosen, utf8, tuple(self._choice(other, logprob) for other, logprob in best[:k]))

    def _choice(self, token_id: int, logprob: float) -> TokenChoice:
        text, utf8 = self._text(token_id)
        return TokenChoice(text, logprob, utf8)

    def _text(self, token_id: int) -> tuple[str, bytes | None]:
        if token_id not in self._known:
            self._known[token_id] = self._read(token_id)
        return self._known[token_id]

    def _read(self, token_id: int) -> tuple[str, bytes | None]:
        if token_id in self._added:
            text = self._added[token_id]
            return text, text.encode("utf-8")
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # past the tokenizer's vocabulary (a model's may be padded)
            return "", None
        utf8 = b"".join(bytes([self._byte_of[char]]) if char in self._byte_of else char.encode("utf-8")
                        for char in token)
        return readable(utf8), utf8


def readable(utf8: bytes) -> str:
    """A token's text: its bytes as UTF-8, or, where they are part of a character, as OpenAI writes
    such a token ("bytes:\\xe4\\xbd")."""
    try:
        return utf8.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in utf8)
