"""Turning reply tokens into text deltas as they come, without splitting a character."""

from typing import Any


class IncrementalDetokenizer:
    # Decoding each new token alone breaks multi-byte characters and the spaces byte-level BPE
    # attaches to words, so decode a short window and emit what it adds once it is complete.
    def __init__(self, tokenizer: Any, strip_leading: bool = False) -> None:
        """`strip_leading`: the text starts at its first character that is not whitespace (an answer
        after its reasoning block, which the model separates from it by blank lines)."""
        self.tokenizer = tokenizer
        self.strip_leading = strip_leading
        self.ids: list[int] = []
        self.prefix_start = 0  # window start: tokens already emitted that give the next ones context
        self.emitted_end = 0  # tokens whose text has been emitted
        self.begun = not strip_leading  # some text has been emitted (or nothing is stripped)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_start : self.emitted_end])
        after = self._decode(self.ids[self.prefix_start :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence, or nothing visible yet
        self.prefix_start, self.emitted_end = self.emitted_end, len(self.ids)
        delta = after[len(before) :]
        if not self.begun:
            delta = delta.lstrip()
            self.begun = bool(delta)
        return delta

    def text(self) -> str:
        text = self._decode(self.ids)
        return text.lstrip() if self.strip_leading else text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
